"""What differs between decoder families, as data: one `Architecture` per model, read from its HF config.

Every forward pass (runner.py) and the relocation of cached keys (rope.py) read this description; none of them
asks which family a model is. The base decoder is Llama's: RMSNorm before attention and before the MLP, RoPE on
every layer, SwiGLU MLP, attention scaled by head_dim**-0.5. A family's file in families/ states what it changes
(`decoder(config, **changes)`), so a new family is one small file and its tests.

Fields left at None cost nothing: the layer loop tests them in Python and skips the op (Llama's description
resolves to exactly the ops it ran before descriptions existed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UnsupportedModelError

# Layer kinds a decoder's `layer_types` may name; others (chunked, linear or recurrent attention) are refused.
LAYER_KINDS = ("full_attention", "sliding_attention")
# RoPE tables other than the default one (`rope_by_layer_type`: Gemma 3's local and global bases) are named by
# the layer type that uses them; one table is named:
DEFAULT_ROPE = "default"


@dataclass(frozen=True)
class Layer:
    """What one decoder layer does differently from the others."""

    rope: str | None  # the RoPE table its queries and keys are rotated with; None: no RoPE (SmolLM3's NoPE layers)
    window: int | None  # sliding window: a query at slot s sees key slots (s - window, s]; None: all of [0, s]


@dataclass(frozen=True)
class Norms:
    """Attribute names of a decoder layer's norm modules, by where they apply (None: the family has none there)."""

    before_attention: str | None = "input_layernorm"
    after_attention: str | None = None  # on the attention output, before the residual add (Gemma 2/3, OLMo 2)
    before_mlp: str | None = "post_attention_layernorm"  # Llama's name for its pre-MLP norm
    after_mlp: str | None = None  # on the MLP output, before the residual add (Gemma 2/3, OLMo 2)


GEMMA_NORMS = Norms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")


@dataclass(frozen=True)
class Architecture:
    model_type: str
    layers: tuple[Layer, ...]
    rope_types: tuple[tuple[str, str], ...]  # (table, rope_type) of every RoPE table a layer uses
    heads: int
    kv_heads: int
    head_dim: int
    attn_scale: float  # query scaling: head_dim**-0.5, Gemma's query_pre_attn_scalar**-0.5, Granite's multiplier
    # The model's rotary module takes the table name (Gemma 3: `rotary_emb(x, positions, layer_type)`).
    rope_by_layer_type: bool = False
    norms: Norms = Norms()
    # RMSNorm of the queries and keys before RoPE: "head" over each head's dims (Qwen3, Gemma 3), "projection" over
    # the whole projection (OLMo 2); the modules are the attention's `q_norm`/`k_norm`.
    qk_norm: str | None = None
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # one name: a fused q|k|v projection (Phi-3)
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # one name: a fused gate|up projection (Phi-3)
    act: str = "act_fn"  # the MLP's activation attribute
    attn_softcap: float | None = None  # logits -> tanh(logits / cap) * cap before the mask (Gemma 2)
    final_softcap: float | None = None  # the same on the output logits (Gemma 2)
    # Granite's multipliers. Gemma's embedding scale (sqrt(hidden), rounded to the weights' dtype) is applied by its
    # own embedding module, which the forward calls: nothing to describe.
    embed_multiplier: float | None = None
    residual_multiplier: float | None = None  # on each sublayer's output before the residual add
    logits_divisor: float | None = None  # Granite's `logits_scaling`

    def __post_init__(self):
        if self.qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm must be None, 'head' or 'projection', got {self.qk_norm!r}")
        tables = {name for name, _ in self.rope_types}
        missing = {layer.rope for layer in self.layers if layer.rope is not None} - tables
        if missing:
            raise ValueError(f"layers use RoPE tables {sorted(missing)} that rope_types does not list")

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct sliding windows of its layers, smallest first."""
        return tuple(sorted({layer.window for layer in self.layers if layer.window is not None}))


def rope_type_of(parameters: dict | None) -> str:
    """The rope_type of one RoPE parameter dict; "mrope" for M-RoPE (sections per modality, `mrope_section`)."""
    parameters = parameters or {}
    if parameters.get("mrope_section") is not None:
        return "mrope"
    return parameters.get("rope_type") or parameters.get("type") or "default"


def sliding_windows(config) -> list[int | None]:
    """Each layer's window: `sliding_window` on the layers `layer_types` marks "sliding_attention" (Qwen2/3,
    SmolLM3, Gemma), on every layer of a config with a window and no layer types (Mistral, Phi-3)."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if unknown:
            raise UnsupportedModelError(f"{config.model_type}: layer_types {unknown} are not attention pc_rag "
                                        f"computes (it handles {', '.join(LAYER_KINDS)})")
        if len(kinds) != n:
            raise UnsupportedModelError(f"{config.model_type}: {len(kinds)} layer_types for {n} layers")
    if window is None:
        return [None] * n
    if kinds is None:
        return [window] * n
    return [window if kind == "sliding_attention" else None for kind in kinds]


def decoder(config, **changes) -> Architecture:
    """The base decoder's description of `config` (Llama's layer, RoPE with one table on every layer, windows
    from `sliding_windows`), with a family's `changes`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = Architecture(
        model_type=config.model_type,
        layers=tuple(Layer(DEFAULT_ROPE, w) for w in sliding_windows(config)),
        rope_types=((DEFAULT_ROPE, rope_type_of(getattr(config, "rope_parameters", None))),),
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        attn_scale=head_dim ** -0.5,
    )
    return replace(base, **changes)
