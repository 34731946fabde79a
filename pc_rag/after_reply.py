"""What a request leaves behind for the next ones, once its reply is out (never before its first token, nor
between its tokens: a store write would stall the stream):

    prefix blocks   the KV the request computed, keyed by the prefix chain (`Assembler.save_prefix`), so the next
                    prompt that starts the same way (a chat's next turn, the same documents) reuses it;
    the reply       its generated tokens, remembered for its text (`ReplyIndex`), so the next turn's prompt carries
                    these very tokens; when a chat template writes it back trimmed, or as its answer alone, that
                    form is run over the prompt's cache and stored too (`remember_continuation`);
    passages        the prompt's passages remembered as sent (`remember_passages`), and those not yet stored encoded
                    on their own in one batched pass (`encode_passages`): the request's leftovers, run once its
                    Generation is out (request.py), so they delay neither its reply nor its end.

The speculative forwards (a continuation, the passages' encodes) run only while no other request is running, and
stop, within a layer of the forward they are in, as soon as one arrives (`Traffic.arrival`,
`LlamaRunner.cancellable`): a request's first token never waits for another's leftovers. What was stopped is left
to later: a passage not stored is encoded by the first request that sends it again; a continuation not stored is
computed by the next turn as fresh tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .assemble import Assembled
from .errors import Cancelled
from .model import release_team
from .plan import COMPUTED, Plan, Wanted
from .reasoning import ThinkingMarkers
from .segments import Chunk, Text

log = logging.getLogger("pc_rag")


def save(engine, prompt, asm: Assembled, replies: Sequence[tuple[Assembled, str, list[int]]], done: bool,
         namespace: str | None) -> list[Wanted]:
    """After a request: `replies` are (its assembled cache, text, token ids) per choice; `done`: the replies ran to
    their end (not an abandoned stream). The prompt's blocks are stored once (with the first choice), each reply's
    own blocks from its buffer. Returns the passages left to encode (`encode_passages`)."""
    saved: frozenset[str] = frozenset()
    for i, (choice, text, ids) in enumerate(replies):
        if ids or not asm.deferred:  # deferred tokens with no first token out may never have been computed
            saved |= engine.assembler.save_prefix(choice, ids[:-1], skip=saved)
            if ids:
                remember_reply(engine, prompt, text, ids, choice if done and i == 0 else None, saved, namespace)
    if any(ids for _, _, ids in replies) or not asm.deferred:
        return remember_passages(engine, asm.plan)
    return []


def remember_reply(engine, prompt, text: str, ids: list[int], asm: Assembled | None = None,
                   saved: frozenset[str] = frozenset(), namespace: str | None = None) -> None:
    """Remember the reply's generated tokens for its text, as generated and as a chat template writes it back
    (trimmed), so the next turn's prompt (in the same cache `namespace`) carries these very tokens (see
    text_index.ReplyIndex).

    When trimming changes the reply's first or last token (" Hello" written back as "Hello"), the KV of the generated
    tokens cannot serve the next turn: with `asm` (a reply that ran to its end), the trimmed reply is run once over
    the prompt's cache and stored as the prefix's other continuation, so a chat's next turn still reuses the previous
    reply. It costs one forward over the reply's tokens (a fraction of decoding them) and only when the template's
    trim would lose them.

    A reply with a thinking block (pc_rag.reasoning) is written back by chat templates as its answer alone (Qwen3's
    drops earlier turns' thinking): the answer is remembered after the prompt too, and run over the prompt's cache
    the same way, so the next turn reuses the prompt and the answer."""
    if isinstance(prompt, str):
        after = prompt
    elif isinstance(prompt, (list, tuple)) and all(isinstance(s, (Text, Chunk)) for s in prompt):
        after = "".join(s.text for s in prompt)
    else:
        return  # PML: its text is not the prompt's text
    if not text.strip():
        return
    answer = ThinkingMarkers.detect(engine.tokenizer).answer(text)
    if answer:
        remember_continuation(engine, answer, after, asm, saved, namespace)

    def decode(t):
        return engine.tokenizer.decode(t, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    end = len(ids)
    while end and decode(ids[:end]) != text:  # EOS, or a stop string, may end the text before the ids
        end -= 1
        if len(text) - len(decode(ids[:end])) > 64:
            end = 0  # not a prefix of the ids' text: give up rather than decode the reply n times
    if not end:
        return
    engine.replies.remember(text, ids[:end], after, namespace)
    stripped = text.strip()
    if stripped != text:
        start = 0
        while start < end and not decode(ids[start:start + 1]).strip():
            start += 1
        while end > start and not decode(ids[end - 1:end]).strip():
            end -= 1
        if decode(ids[start:end]) == stripped:
            engine.replies.remember(stripped, ids[start:end], after, namespace)
            return
        remember_continuation(engine, stripped, after, asm, saved, namespace)


def remember_continuation(engine, text: str, after: str, asm: Assembled | None, saved: frozenset[str],
                          namespace: str | None) -> None:
    """Remember `text`, which the model did not generate as such right after the prompt `after` (a trimmed reply, or
    the answer after a thinking block), as that prompt's reply, with the ids the next turn's prompt tokenizes it
    into; with `asm`, run them over the prompt's cache and store them as its other continuation.

    Only while no other request is running, and stopped within a layer when one arrives: the forward is speculative
    (a next turn may never come) and would take the runner's turns from requests that are decoding (two such
    forwards took 150 ms of an 8-stream burst's 1.2 s, bench model). Skipped, the next turn computes the same tokens
    as fresh ones."""
    alt = engine.segmenter.ids(text, namespace)  # how the next turn's prompt tokenizes it (a hard cut)
    engine.replies.remember(text, alt, after, namespace)
    if asm is None or engine.traffic.busy():
        return
    layout = asm.plan.layout  # the request's stored prefix must run to the prompt's end for a reply to continue it
    continues = bool(layout) and getattr(layout[-1], "end", None) == asm.prompt_tokens
    if continues and len(alt) <= asm.cache.capacity - asm.prompt_tokens:
        first = asm.last_position + 1
        slots = list(range(asm.prompt_tokens, asm.prompt_tokens + len(alt)))
        try:
            with engine.runner.cancellable(engine.traffic.arrival(mine=1)):  # this request is still counted
                engine.runner.forward(asm.cache, list(alt), list(range(first, first + len(alt))), slots)
        except Cancelled:
            return
        engine.assembler.save_prefix(asm, alt, skip=saved)


def remember_passages(engine, plan: Plan) -> list[Wanted]:
    """Count what the prompt's passages did and remember them as sent in the request's namespace; returns those
    whose own encoding is not stored, for `encode_passages`."""
    if not plan.passages:
        return []
    index = engine.planner.passages
    reused = [p for p in plan.as_built().pieces if p.kind == "passage"]
    encoded = {p.key for p in reused if p.origin == COMPUTED}
    index.count(requests=1, reused=sum(p.key not in encoded for p in reused),
                reused_tokens=sum(p.n for p in reused if p.key not in encoded), encoded=len(encoded))
    index.add(plan.namespace, ((w.key, len(w.token_ids)) for w in plan.passages))
    return list({w.key: w for w in plan.passages if w.key not in plan.passages_held and w.key not in encoded}.values())


def encode_passages(engine, passages: Sequence[Wanted]) -> None:
    """A request's leftovers (request.py): `passages` (`remember_passages`) encoded on their own and stored, so that
    the next request finds them wherever they land. One batched pass (`Assembler.store_missing`), about one prefill
    of their tokens, run outside any request and only while none runs; a request that arrives stops it within a
    layer (its first token waits for no more), and the passages not stored are encoded by the first request that
    sends them again. Best effort: a failure is logged."""
    if not passages or not engine.traffic.idle():
        return
    index = engine.planner.passages
    try:
        with engine.runner.cancellable(engine.traffic.arrival()):
            index.count(encoded_after_reply=engine.assembler.store_missing(passages, "after_reply"))
    except Cancelled:
        index.count(stopped_after_reply=1)
    except Exception:  # speculative work: the reply is out and must stay a success
        log.warning("encoding a prompt's passages after the reply failed", exc_info=True)
    finally:
        release_team()  # this thread computed again; a server's request thread now waits (model/threads.py)
