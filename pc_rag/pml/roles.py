"""PML chat roles from the tokenizer's own chat template."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PMLError


@dataclass(frozen=True)
class ChatRoles:
    """Text around each role's content, cut out of the tokenizer's own chat template."""

    prefix: dict[str, str]
    suffix: dict[str, str]
    trims: bool  # the template strips whitespace around contents

    def wrap(self, role: str, where: str) -> tuple[str, str]:
        if role not in self.prefix:
            raise PMLError(f"{where}: this tokenizer's chat template has no <{role}> role")
        return self.prefix[role], self.suffix[role]


_PH = {"system": "pmlSYSTEMpml", "user": "pmlUSERpml", "assistant": "pmlASSISTANTpml", "user2": "pmlUSER2pml"}


def chat_roles(tokenizer) -> ChatRoles | None:
    """Derive role prefixes/suffixes by rendering placeholder conversations; None when there is no template.

    From [system A, user B, assistant C, user D]: text before A is the system prefix; the generation prompt
    (rendering with and without `add_generation_prompt`) is the assistant prefix; the assistant suffix is
    what follows C when C is last; the rest is cut accordingly. A leading BOS string is removed: the BOS sink
    comes from the segment layout. A template that refuses a system message gives user/assistant only.
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    bos = getattr(tokenizer, "bos_token", None) or ""

    def render(messages, gen=False) -> str:
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        return out[len(bos) :] if bos and out.startswith(bos) else out

    def msg(role, key=None):
        return {"role": role, "content": _PH[key or role]}

    def between(text, a, b):
        i, j = text.index(_PH[a]) + len(_PH[a]), text.index(_PH[b])
        if j < i:
            raise ValueError("placeholders out of order")
        return text[i:j]

    try:
        with_system = True
        try:
            r3 = render([msg("system"), msg("user"), msg("assistant")])
        except Exception:  # the template rejects system messages (raise_exception in Jinja)
            with_system = False
        head = [msg("system")] if with_system else []
        r3 = render([*head, msg("user"), msg("assistant")])
        r4 = render([*head, msg("user"), msg("assistant"), msg("user", "user2")])
        plain = render([*head, msg("user")])
        gen_full = render([*head, msg("user")], gen=True)
        if not gen_full.startswith(plain):
            raise ValueError("generation prompt is not an extension of the conversation")
        asst_prefix = gen_full[len(plain) :]
        asst_suffix = r3[r3.index(_PH["assistant"]) + len(_PH["assistant"]) :]
        c_to_d = between(r4, "assistant", "user2")
        if not c_to_d.startswith(asst_suffix):
            raise ValueError("assistant suffix differs mid-conversation")
        user_prefix = c_to_d[len(asst_suffix) :]
        b_to_c = between(r3, "user", "assistant")
        if not b_to_c.endswith(asst_prefix):
            raise ValueError("assistant prefix differs mid-conversation")
        user_suffix = b_to_c[: len(b_to_c) - len(asst_prefix)]
        prefix = {"user": user_prefix, "assistant": asst_prefix}
        suffix = {"user": user_suffix, "assistant": asst_suffix}
        if with_system:
            a_to_b = between(r3, "system", "user")
            if not a_to_b.endswith(user_prefix):
                raise ValueError("user prefix differs after a system message")
            prefix["system"] = r3[: r3.index(_PH["system"])]
            suffix["system"] = a_to_b[: len(a_to_b) - len(user_prefix)]
        spaced = render([{"role": "user", "content": " " + _PH["user"] + " "}])
        trims = (" " + _PH["user"] + " ") not in spaced
    except Exception as e:  # any template we cannot cut apart: role tags then fail with this reason
        raise PMLError(f"cannot derive chat roles from this tokenizer's chat template: {e}") from None
    return ChatRoles(prefix, suffix, trims)
