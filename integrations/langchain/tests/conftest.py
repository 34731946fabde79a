import os
import tempfile

# Nothing in these tests may reach a model hub: the test model is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Engines built with the default store (model=PATH) write their disk tier here, not to ~/.cache.
os.environ.setdefault("PC_RAG_CACHE_DIR", tempfile.mkdtemp(prefix="pc_rag_test_cache_"))
