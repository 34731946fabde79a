"""A PromptCacheLLM that keeps what every request sent and got, so tests can see the segments and usage."""

from llama_index.llms.pc_rag import PromptCacheLLM

from pc_rag.segments import Chunk


class RecordingLLM(PromptCacheLLM):
    """Keeps the segments and usage of every request, so a test can see what the engine was sent."""

    def _sent(self, segments):
        self.records.append({"segments": segments})

    def _raw(self, generation, finish_reason):
        raw = super()._raw(generation, finish_reason)
        self.records[-1].update(raw=raw, text=generation.text)
        return raw

    @property
    def records(self):
        return self.__dict__.setdefault("_records", [])


def chunks_per_call(llm):
    return [sum(isinstance(s, Chunk) for s in r["segments"]) for r in llm.records]


def chunk_texts(record):
    """The texts sent as chunks, stripped (the engine widens a chunk to token boundaries: " topic: ...")."""
    return [s.text.strip() for s in record["segments"] if isinstance(s, Chunk)]
