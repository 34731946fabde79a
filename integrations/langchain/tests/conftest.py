import os

# Nothing in these tests may reach a model hub: the test model is built locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
