"""One exception family: every error a user can cause is a PCRagError naming the bad input."""


class PCRagError(Exception):
    """Base class of every error pc_rag raises on purpose."""


class PromptError(PCRagError, ValueError):
    """The prompt itself is unusable (empty, too long, wrong segment type)."""


class UnsupportedModelError(PCRagError, ValueError):
    """The checkpoint is not a decoder of a supported family, or its cached keys cannot be relocated exactly (a
    RoPE that changes with the sequence length, or a failed relocation self-check): modular and blend only."""


class CheckpointError(PCRagError, OSError):
    """A path given to `from_pretrained` is missing, not a checkpoint, unreadable, or quantized in a format pc_rag
    cannot run; the message names the path, what is wrong and what to pass instead. An OSError, as transformers'
    own loading errors are."""


class PMLError(PromptError):
    """A PML schema or prompt is malformed, hostile or does not fit its schema; names the element and line. A
    PromptError: what a PML prompt holds is the prompt, and a caller that catches PromptError catches it too."""


class StoreError(PCRagError):
    """A KV store tier failed; callers treat it as a miss and recompute."""


class OptionError(PCRagError, ValueError):
    """A generation option (max_new_tokens, temperature, top_p, stop, seed, recompute_ratio) or a device is out
    of range or unavailable; the message names the argument and what it accepts. An unknown `mode` is a
    PromptError, as it always was."""


class OptionTypeError(OptionError, TypeError):
    """An option of the wrong type (`temperature="0.7"`, `seed=True`, `stop=[1]`): also a TypeError."""


class Cancelled(PCRagError):
    """A request stopped by its caller before its first token (`LlamaRunner.cancellable`): a server's client
    that disconnected, or a deadline that passed."""


class ReplyCutError(PCRagError, ValueError):
    """The token budget (max_new_tokens; OpenAI's max_tokens) ended a reply inside the tool call or the JSON it was
    asked for: raised where a framework has no place for a partial call (LlamaIndex)."""


class GrammarError(PCRagError):
    """A reply under a grammar (a JSON schema, a forced tool call) could not be completed: its grammar reached a dead
    end, or one of the grammar engine's limits, before it accepted the reply (`Generation.finish_reason` "error",
    `Generation.error` says why). Raised where a framework has no place for an incomplete reply (LlamaIndex)."""
