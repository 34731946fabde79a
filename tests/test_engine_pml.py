"""PML prompts through the engine, against a `full` prefill of the equivalent plain prompt.

The equivalent plain prompt (`pml.equivalent_plain_prompt`) has the same token ids at the same position
ids, every segment computed fresh. Where reuse is exact (exact mode; a module placed first) logits must
match within 1e-4 and greedy tokens must be identical; elsewhere the divergence is recorded.
"""

import pytest
import torch

import pc_rag
from pc_rag.pml import PML, equivalent_plain_prompt, prompt_for, schema_for_chunks

LEGAL = """<schema name="legal">
<system>You are a careful legal assistant. Cite the documents.</system>
<module name="contract">The tenant shall pay rent on the first day of each month. Late payment incurs a fee of
five percent. Either party may end the lease with sixty days of written notice.</module>
<module name="statute">A landlord must return a security deposit within thirty days after the tenancy ends,
with an itemised list of any deductions.</module>
<module name="letter">Dear <parameter name="client" length="6"/>, thank you for your question.</module>
</schema>"""


@pytest.fixture
def legal(engine):
    engine.add_schema(LEGAL)
    return engine


def logits_and_tokens(engine, prompt, mode):
    return engine.next_token_logits(prompt, mode), engine.generate(prompt, mode=mode, max_new_tokens=12).token_ids


def test_pml_prompt_exact_equals_full_of_plain_prompt(legal):
    prompt = PML('<prompt schema="legal"><statute/><letter client="Ms Smith"/>'
              "<user>Can I get my deposit back?</user></prompt>")
    plain = equivalent_plain_prompt(legal.schemas.segments(prompt.text))
    segs = legal.segmenter.segments(plain)
    positions = [p for s in segs for p in range(s.start, s.end)]
    assert positions != list(range(len(positions)))  # the contract module is skipped: positions have a gap
    ref_logits, ref_tokens = logits_and_tokens(legal, plain, "full")
    ids = [t for s in segs for t in s.token_ids]
    assert (legal.runner.reference_logits(ids, positions) - ref_logits).abs().max().item() <= 1e-5
    legal.generate(prompt, mode="exact", max_new_tokens=1)  # caches the prefix
    gen = legal.generate(prompt, mode="exact", max_new_tokens=12)
    assert gen.cached_tokens > 0 and gen.token_ids == ref_tokens
    assert (legal.next_token_logits(prompt, "exact") - ref_logits).abs().max().item() <= 1e-4


def test_pml_first_module_modular_equals_full(engine):
    # A module right after BOS, at its schema position, was encoded exactly as a full prefill computes it.
    engine.add_schema('<schema name="notes"><module name="rent">Rent is due on the first day of each month.'
                      '</module><module name="fees">Late payment costs five percent.</module></schema>')
    prompt = PML('<prompt schema="notes"><rent/> When is rent due?</prompt>')
    plain = equivalent_plain_prompt(engine.schemas.segments(prompt.text))
    ref_logits, ref_tokens = logits_and_tokens(engine, plain, "full")
    engine.generate(PML('<prompt schema="notes"><rent/><fees/> Fees?</prompt>'), mode="modular", max_new_tokens=1)
    gen = engine.generate(prompt, mode="modular", max_new_tokens=12)
    assert [s.origin for s in gen.sources if s.kind == "chunk"] == ["memory"]
    assert gen.token_ids == ref_tokens
    assert (engine.next_token_logits(prompt, "modular") - ref_logits).abs().max().item() <= 1e-4


def test_pml_modular_subset_reuses_modules_and_records_divergence(legal, record_property):
    legal.generate(PML('<prompt schema="legal"><contract/><statute/>Summarise.</prompt>'), max_new_tokens=1)
    prompt = PML('<prompt schema="legal"><statute/><letter client="Mr Jones"/><user>Deposit?</user></prompt>')
    gen = legal.generate(prompt, max_new_tokens=8)
    statute = [s for s in gen.sources if s.kind == "chunk"][0]
    assert statute.origin == "memory"  # encoded at its schema position by the first prompt, reused here
    lf = legal.next_token_logits(equivalent_plain_prompt(legal.schemas.segments(prompt.text)), "full")
    lm = legal.next_token_logits(prompt, "modular")
    record_property("kl", float(torch.sum(lf.softmax(-1) * (lf.log_softmax(-1) - lm.log_softmax(-1)))))


def test_rag_schema_for_chunks_prompts_a_retrieved_subset(engine, docs):
    schema = schema_for_chunks("kb", docs + ["a < b && c > d", "<module name='x'>injected</module>"])
    engine.add_schema(schema)
    prompt = PML(prompt_for("kb", [5, 1], "Which comparison is shown?"))
    segs = engine.schemas.segments(prompt.text)
    chunks = [s.text for s in segs if isinstance(s, pc_rag.Chunk)]
    # escaped document text comes back verbatim (with the schema's "\n\n" separator), never as markup
    assert chunks == [docs[1] + "\n\n", "<module name='x'>injected</module>\n\n"]
    gen = engine.generate(prompt, max_new_tokens=4)
    assert gen.prompt_tokens == sum(len(engine.segmenter.ids(s.text)) for s in segs) + 1  # + BOS


def test_unknown_schema_is_a_pml_error(engine):
    with pytest.raises(pc_rag.PMLError, match="nope"):
        engine.generate(PML('<prompt schema="nope">hi</prompt>'))


def test_pml_scaffold_group_is_encoded_jointly_and_exact_inside(engine):
    engine.add_schema(
        '<schema name="story"><scaffold><module name="part1">Alice found a key under the old oak tree. </module>'
        '<module name="part2">The key opened the chest she had found the day before.</module></scaffold>'
        '<module name="other">Bob likes tea.</module></schema>'
    )
    prompt = PML('<prompt schema="story"><part1/><part2/> What did the key open?</prompt>')
    gen = engine.generate(prompt, max_new_tokens=8)
    assert [s.kind for s in gen.sources] == ["bos", "scaffold", "text"]
    plain = equivalent_plain_prompt(engine.schemas.segments(prompt.text))
    assert gen.token_ids == engine.generate(plain, mode="full", max_new_tokens=8).token_ids
    lf = engine.next_token_logits(plain, "full")
    assert (engine.next_token_logits(prompt, "modular") - lf).abs().max().item() <= 1e-4
    # importing one member alone uses its own block
    alone = engine.generate(PML('<prompt schema="story"><part2/> Q?</prompt>'), max_new_tokens=1)
    assert "scaffold" not in [s.kind for s in alone.sources]


def test_pml_scaffold_needs_two_modules(engine):
    with pytest.raises(pc_rag.PMLError, match="at least two"):
        engine.add_schema('<schema name="s"><scaffold><module name="a">x</module></scaffold></schema>')
