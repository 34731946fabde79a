"""The `pc-rag` command (also `python -m pc_rag`): demo, warm, explain, check, stats, clear, bench, serve.

Cache folder (`--cache-dir`, default $PC_RAG_CACHE_DIR, else $XDG_CACHE_HOME/pc_rag, else ~/.cache/pc_rag):

    pc_rag-kv-v1/       KV blocks of the disk store, kv-<key>.safetensors (the disk tier of an Engine with
                        the default store; `stats` and `clear` see only these names, nothing else there)
    embeddings/         chunk embedding matrices of the demo's FAISS index, keyed by the chunk texts
    models/bench/       the offline demo Llama (random weights), built on first use when no --model is given
    calibration/        APE's temperature and scale per model fingerprint, ape-<hash>.json (`check --calibrate-ape`;
                        read by every engine whose disk tier is this folder: `serve`, `explain`)
    public-documents.jsonl  the chunks `warm --public` declared public (one JSON string a line): `serve` with
                        this folder registers them as shared by every tenant (docs/serve.md, "Security")

Errors a user can cause (a bad path, a model of an unsupported family, a missing optional package) print one line
on stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shutil
import sys
import threading
from pathlib import Path

from .errors import PCRagError, UnsupportedModelError

EXIT_USAGE = 2
_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"  # in a source checkout, beside pc_rag/


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["demo"]  # `pc-rag` and `python -m pc_rag` alone run the demo
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.run(args, extra)
    except KeyboardInterrupt:
        print("pc-rag: interrupted", file=sys.stderr)
        return 130
    except (PCRagError, OSError, ValueError, ImportError) as e:
        # Library errors name the bad input and the fix; transformers' load errors are several lines long,
        # and their first line is the one that says what was wrong.
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"pc-rag {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", type=Path, default=None,
                        help="cache folder (default: $PC_RAG_CACHE_DIR, else ~/.cache/pc_rag)")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", help="local HF decoder checkpoint folder, GGUF file, or hub id (families: "
                                       "docs/models.md; default: the offline demo model, random weights, built once "
                                       "into the cache folder)")
    model.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16: the activations' "
                       "(and a float checkpoint's weights')")
    model.add_argument("--quantize", default=None, metavar="SCHEME",
                       help="q4_k, q4_0 or q8_0: quantize a float checkpoint's matrices as it loads (a GGUF file keeps "
                            "its own formats)")
    model.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    model.add_argument("--store", action="append", metavar="SPEC",
                       help="store tier spec, repeatable, top tier first (default: memory over disk in the "
                            "cache folder); see docs/store.md")

    parser = argparse.ArgumentParser(prog="pc-rag", description="Prompt Cache for RAG: reuse document KV on a "
                                     "local Llama. With no command, runs the demo.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("demo", parents=[common, model], help="RAG over Python's docs: TTFT per mode, cache hits",
                       description="Answer questions over Python's documentation in every mode and print TTFT, "
                                   "cached vs computed tokens and the store hit rate. Run it twice: the second "
                                   "process finds the KV on disk.")
    p.add_argument("--questions", type=int, default=None, metavar="N", help="ask the first N built-in questions")
    p.add_argument("--question", action="append", metavar="TEXT", help="ask this question (repeatable)")
    p.add_argument("-k", type=int, default=4, help="chunks retrieved per question (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-chunks", type=int, default=None, metavar="N",
                   help="index only the first N chunks of the corpus (quick runs)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_demo)

    p = sub.add_parser("warm", parents=[common, model], help="encode the KV of .txt/.md files into the store",
                       description="Encode and store the KV of the chunks of .txt/.md files. By default in no cache "
                                   "namespace: what engine calls without a cache_salt and a `pc-rag serve` without "
                                   "keys (or with --shared-cache) reuse. A server with keys keeps each tenant's "
                                   "cache apart: warm for one tenant (--tenant) or declare the documents public.")
    p.add_argument("paths", nargs="+", metavar="DIR_OR_FILE")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--public", action="store_true",
                       help="declare these documents public: recorded in the cache folder, `pc-rag serve` with the "
                            "same folder shares their KV with every tenant (a tenant can learn whether a public "
                            "document is cached, nothing else)")
    scope.add_argument("--tenant", metavar="NAME",
                       help="warm into this tenant's namespace (its name in the server's key file)")
    p.set_defaults(run=_warm)

    p = sub.add_parser("explain", parents=[common, model],
                       help="where each piece of a prompt's KV would come from, without running the model",
                       description="Plan a prompt as a request would and print it piece by piece: tokens, slots, "
                                   "positions, and where its KV would come from (a memory, disk or Redis hit, an "
                                   "encode, or the forward). Runs no forward pass and leaves the store as it is. "
                                   "Texts given with --chunk, or the chunks of --docs files (as `warm` cuts them), "
                                   "become chunks wherever they appear in the prompt.")
    p.add_argument("prompt", help="the prompt text; '-' reads it from stdin")
    p.add_argument("--mode", default="modular", help="full, exact, modular (default) or blend")
    p.add_argument("--align", choices=["ape"], default=None,
                   help="APE's temperature and scale on the attention over reused chunks (modular, blend)")
    p.add_argument("--chunk", action="append", default=[], metavar="TEXT", help="a document text (repeatable)")
    p.add_argument("--docs", action="append", default=[], metavar="DIR_OR_FILE",
                   help=".txt/.md files or folders whose chunks are documents (repeatable)")
    p.add_argument("--json", action="store_true", help="print the rows and totals as JSON")
    p.set_defaults(run=_explain)

    p = sub.add_parser("check", parents=[common, model],
                       help="how often each reusing mode answers as full does on your documents, and how much faster",
                       description="Answer each question (retrieved from --docs as the demo does) or each prompt of "
                                   "--prompts in full and in each reusing mode, and report per mode: the share of "
                                   "greedy answers identical to full's, where they first differ, the mean next-token "
                                   "KL from full over full's answer (teacher-forced), the median time to first "
                                   "token; then the cheapest mode within --target. Documents are encoded before "
                                   "measuring (a new question over documents seen before). See pc_rag/check.py.")
    p.add_argument("--docs", action="append", default=[], metavar="DIR_OR_FILE",
                   help=".txt/.md files or folders to retrieve from, cut as `warm` cuts them (repeatable; default: "
                        "the demo's corpus, Python's documentation topics)")
    p.add_argument("--questions", type=Path, metavar="FILE", help="questions, one per line")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="instead of --docs/--questions: prompts, one JSON value per line: a string (sent as it is, "
                        "its documents reused as passages), or {\"system\": ..., \"documents\": [...], "
                        "\"question\": ...} (each document a chunk)")
    p.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help="modes to compare with full: exact, modular, blend[:RATIO[:SELECTION]] (SELECTION: "
                        "progressive, deviation, chunk_start), auto[:TARGET], each but exact with :ape for APE "
                        "(ape alone: modular:ape); default: " + " ".join(_check_defaults()))
    p.add_argument("--target", type=float, default=0.9, help="agreement a mode must reach to be recommended (0.9)")
    p.add_argument("-k", type=int, default=4, help="chunks retrieved per question (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=16,
                   help="length of the greedy answers compared (default 16)")
    p.add_argument("--plain", action="store_true",
                   help="send each prompt as one string, as apps that join the documents in themselves do (the "
                        "documents are then reused as passages)")
    p.add_argument("--max-chunks", type=int, default=None, metavar="N",
                   help="retrieve from the first N chunks only (quick runs)")
    p.add_argument("--calibrate-ape", action="store_true",
                   help="first choose APE's temperature and scale for this model on these prompts (pc_rag/align.py) "
                        "and save them in the cache folder, where `serve`, `explain` and later checks find them; "
                        "the :ape modes then use them")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(run=_check)

    p = sub.add_parser("stats", parents=[common], help="what the cache folder holds")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_stats)

    p = sub.add_parser("clear", parents=[common], help="remove the cached KV blocks")
    p.add_argument("--all", action="store_true", help="also remove cached embeddings, the built demo model, "
                                                      "APE calibrations and the list of public documents")
    p.set_defaults(run=_clear)

    p = sub.add_parser("serve", parents=[common, model], help="an OpenAI-compatible HTTP server (docs/serve.md)",
                       description="Serve the model over HTTP with OpenAI's API (/v1/chat/completions, "
                                   "/v1/completions, /v1/models, /health): concurrent requests are decoded "
                                   "together and share the KV store. Needs the `serve` extra (fastapi, uvicorn).")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1, this machine only; 0.0.0.0 for every interface, "
                        "then set --api-key)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; default: $PC_RAG_API_KEY; none: "
                        "no auth). Visible to local users in the process list: prefer --api-keys or the environment")
    p.add_argument("--api-keys", metavar="FILE",
                   help="keys from a file, one 'KEY [TENANT]' per line, # comments (also: $PC_RAG_API_KEYS, "
                        "entries separated by newlines or commas)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="also serve this Host name (repeatable); on loopback without a key only loopback names "
                        "are served otherwise (DNS rebinding)")
    p.add_argument("--max-body-bytes", type=int, default=None, metavar="N",
                   help="largest request body; more is refused with 413 before it is read (default 4 MiB)")
    p.add_argument("--max-prompt-chars", type=int, default=None, metavar="N",
                   help="largest prompt in characters, all its texts together, refused before tokenizing "
                        "(default: 16 per token of the model's context)")
    p.add_argument("--max-prompt-parts", type=int, default=None, metavar="N",
                   help="most messages, content parts, chunks and stop strings in one request (default 1024)")
    p.add_argument("--read-timeout", type=float, default=None, metavar="S",
                   help="seconds a client has to send a request's head, and again its body (default 30)")
    p.add_argument("--prefill-timeout", type=float, default=None, metavar="S",
                   help="a request without its first token after this long is stopped and answered 503 "
                        "(default 300)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id /v1/models lists and responses carry (default: the --model folder's name)")
    p.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="requests running at once (default: the engine's batch size, 16)")
    p.add_argument("--max-waiting", type=int, default=64, metavar="N",
                   help="requests waiting for a place; beyond it: 429 with Retry-After (default 64)")
    p.add_argument("--queue-timeout", type=float, default=60.0, metavar="S",
                   help="seconds a request may wait for a place; then 503 with Retry-After (default 60)")
    p.add_argument("--ttft-limit", type=float, default=None, metavar="S",
                   help="refuse (429 with Retry-After) a request whose first token would, by the recent prefills, "
                        "come later than this: past saturation, answered requests keep a bounded wait "
                        "(default: off, every request waits its turn)")
    p.add_argument("--passages-from-first-sight", action="store_true",
                   help="reuse the documents of plain-text prompts from their first sight, each encoded on its own "
                        "as a marked document is (modular, blend): under load a document that comes back then "
                        "costs no second encode; a prompt whose documents are all new gets modular's approximation "
                        "instead of an exact prefill (default: off, docs/design.md 'Passages')")
    p.add_argument("--default-max-tokens", type=int, default=1024, metavar="N",
                   help="max_tokens of a request that sets none (default 1024)")
    p.add_argument("--shared-cache", action="store_true",
                   help="one cache for every tenant (a single trusted tenant: users who may read each other's "
                        "prompts); default: each tenant's cache is its own, public documents shared")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(run=_serve)

    p = sub.add_parser("bench", help="run python -m benchmarks.ttft (arguments pass through; try `bench -h`)",
                       add_help=False)
    p.set_defaults(run=_bench)
    return parser


# ---- commands --------------------------------------------------------------------------------------------
def _cache_dir(args) -> Path:
    from .store import default_cache_dir

    return (args.cache_dir or default_cache_dir()).expanduser()


def _engine(args, cache_dir: Path):
    """(engine, model path or id, whether its weights are random), loaded as the options say."""
    from . import Engine
    from .demo import demo_model
    from .model import parse_dtype
    from .options import check_device

    # Before building the demo model or reading a checkpoint: `--device cuda` on a CPU-only torch was an
    # AssertionError traceback from inside torch, after the weights had loaded.
    check_device(args.device)
    parse_dtype(args.dtype)
    _quiet_transformers()
    path = _check_model(args.model) if args.model else str(demo_model(cache_dir))
    store = args.store or ["memory", f"disk:{cache_dir}"]
    engine = Engine.from_pretrained(path, dtype=args.dtype, device=args.device, store=store, quantize=args.quantize)
    random_weights = Path(path, "pc_rag_test_model.json").is_file()  # pc_rag.testing's offline models
    return engine, path, random_weights


def _check_model(model: str) -> str:
    """A path must hold a checkpoint (a folder with config.json, or a GGUF file or a folder holding one: checked as
    from_pretrained checks it); anything that is not a hub id ("org/name") must exist."""
    from .model import checkpoint

    path = Path(model).expanduser()
    if path.exists():
        try:
            checkpoint.locate(path)
        except PCRagError as e:
            raise PCRagError(f"--model {e}") from None
        return str(path)
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or os.sep != "/" and os.sep in model:
        raise PCRagError(f"--model {model}: no such folder")
    return model  # a hub id: transformers resolves (or downloads) it


def _demo(args, _extra) -> int:
    from .demo import QUESTIONS, format_report, run_demo
    from .demo.embeddings import SentenceEmbedder
    from .demo.retrieval import VectorIndex, corpus_chunks

    questions = list(args.question or QUESTIONS[: args.questions])
    if not questions:
        raise PCRagError("no questions: use --questions N with N >= 1 or --question TEXT")
    if args.k < 1:
        raise PCRagError(f"-k must be >= 1, got {args.k}")
    cache_dir = _cache_dir(args)
    progress = not args.json and sys.stderr.isatty()
    engine, path, random_weights = _engine(args, cache_dir)
    index = VectorIndex.build(corpus_chunks(args.max_chunks), SentenceEmbedder(),
                              cache_dir=cache_dir / "embeddings", progress=progress)
    report = run_demo(engine, index, questions, k=args.k, max_new_tokens=args.max_new_tokens, model_name=path,
                      cache_dir=str(cache_dir), random_weights=random_weights)
    print(report.to_json() if args.json else format_report(report))
    return 0


def _warm(args, _extra) -> int:
    from . import Chunk
    from .blocks import tenant_namespace
    from .demo.retrieval import read_documents

    if args.tenant is not None and not args.tenant.strip():
        raise PCRagError("--tenant is empty; give the tenant's name as in the server's key file")
    chunks = read_documents(args.paths)  # before loading a model: a bad path fails fast
    cache_dir = _cache_dir(args)
    engine, _, _ = _engine(args, cache_dir)
    namespace = tenant_namespace(args.tenant) if args.tenant else None
    new = engine.warm([Chunk(c, public=args.public) for c in chunks], progress=True, cache_salt=namespace)
    where = f" for tenant {args.tenant}" if args.tenant else ""
    print(f"{len(chunks)} chunks{where}: {new} encoded and stored, {len(chunks) - new} were already cached")
    if args.public:
        added = add_public_documents(cache_dir, chunks)
        print(f"{added} newly declared public in {cache_dir / PUBLIC_DOCUMENTS} (read by pc-rag serve at start)")
    return 0


PUBLIC_DOCUMENTS = "public-documents.jsonl"


def public_documents(cache_dir: Path) -> list[str]:
    """The texts `warm --public` declared public in this cache folder, in order, each once."""
    import json

    path = cache_dir / PUBLIC_DOCUMENTS
    if not path.is_file():
        return []
    texts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                text = json.loads(line)
            except ValueError:
                raise PCRagError(f"{path}:{n}: not a JSON string; rerun pc-rag warm --public, or remove the "
                                 f"line") from None
            if not isinstance(text, str):
                raise PCRagError(f"{path}:{n}: not a JSON string")
            texts.append(text)
    return list(dict.fromkeys(texts))


def add_public_documents(cache_dir: Path, texts: list[str]) -> int:
    """Append the texts not declared yet; return how many were new."""
    import json

    known = set(public_documents(cache_dir))
    new = [t for t in dict.fromkeys(texts) if t not in known]
    if new:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with open(cache_dir / PUBLIC_DOCUMENTS, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(t, ensure_ascii=False) + "\n" for t in new))
    return len(new)


def _explain(args, _extra) -> int:
    import json
    from dataclasses import asdict

    from .align import check_align
    from .demo.retrieval import read_documents
    from .options import check_mode

    check_mode(args.mode)
    check_align(args.align, args.mode)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise PCRagError("the prompt is empty; pass its text, or '-' to read it from stdin")
    chunks = list(args.chunk) + (read_documents(args.docs) if args.docs else [])  # bad paths fail before the model
    engine, _, _ = _engine(args, _cache_dir(args))
    explained = engine.explain(engine.split(prompt, chunk_texts=chunks), args.mode, align=args.align)
    if args.json:
        ape = explained.plan.align
        print(json.dumps({"mode": explained.mode, "prompt_tokens": len(explained.plan.ids),
                          "ape": ape.as_dict() if ape is not None else None,
                          "reused_tokens": explained.reused_tokens, "encoded_tokens": explained.encoded_tokens,
                          "computed_tokens": explained.computed_tokens, "stored_tokens": explained.plan.stored_tokens,
                          "rows": [asdict(r) for r in explained.rows]}, indent=2))
    else:
        print(explained)
    return 0


def _check_defaults() -> tuple[str, ...]:
    from .check import DEFAULT_MODES

    return DEFAULT_MODES


def _check(args, _extra) -> int:
    import json

    from . import align
    from .check import Setting, check

    modes = [Setting.parse(m) for m in (args.modes or _check_defaults())]  # a bad mode fails before the model loads
    if args.calibrate_ape and not any(m.align for m in modes):
        modes.append(Setting.parse("modular:ape"))  # what the calibration was for, measured beside the rest
    if not 0.0 <= args.target <= 1.0:
        raise PCRagError(f"--target is an agreement share in [0, 1], got {args.target}")
    if args.k < 1 or args.max_new_tokens < 1:
        raise PCRagError("-k and --max-new-tokens must be >= 1")
    if args.prompts is not None:
        if args.questions is not None or args.docs:
            raise PCRagError("--prompts holds whole prompts: give it alone, or --docs and --questions")
        prompts = _read_prompts(args.prompts, args.plain)
    elif args.questions is None:
        raise PCRagError("give --questions FILE (one question per line, answered over --docs) or --prompts FILE")
    else:
        questions = _read_questions(args.questions)
        if args.docs:
            from .demo.retrieval import read_documents

            chunks = read_documents(args.docs)  # a bad path fails before the model loads
        else:
            from .demo.retrieval import corpus_chunks

            chunks = corpus_chunks(args.max_chunks)
        if args.max_chunks is not None:
            chunks = chunks[: args.max_chunks]
    cache_dir = _cache_dir(args)
    progress = sys.stderr.isatty()
    args.store = args.store or ["memory"]  # the check's prompts stay out of the cache folder unless asked
    engine, path, random_weights = _engine(args, cache_dir)
    if args.prompts is None:
        from .check import rag_prompt
        from .demo import SYSTEM
        from .demo.embeddings import SentenceEmbedder
        from .demo.retrieval import VectorIndex

        index = VectorIndex.build(chunks, SentenceEmbedder(), cache_dir=cache_dir / "embeddings", progress=progress)
        prompts = [rag_prompt([c for c, _ in index.search(q, args.k)], q, SYSTEM, args.plain) for q in questions]
    # The check's store is memory only, but APE's calibration belongs to the cache folder: the one saved there is
    # used by the :ape modes, and --calibrate-ape writes it there.
    engine.keep_calibrations_in(cache_dir)
    calibrated = None
    if args.calibrate_ape:
        ape, table = engine.calibrate_ape(prompts)
        calibrated = {**ape.as_dict(), "prompts": len(prompts),
                      "saved": str(align.calibration_file(cache_dir, engine.planner.fingerprint)),
                      "modular_kl": table[(1.0, 1.0)]["kl"], "kl": table[(ape.temperature, ape.scale)]["kl"]}
    report = check(engine, prompts, modes, max_new_tokens=args.max_new_tokens, target=args.target, progress=progress)
    if args.json:
        out = report.as_dict()
        out.update(model=path, random_weights=random_weights, plain=args.plain, ape_calibration=calibrated)
        print(json.dumps(out, indent=2))
    else:
        print(f"model: {path}" + (" (random weights: its answers are meaningless words; the comparison is real)"
                                  if random_weights else ""))
        if calibrated:
            print(f"APE calibrated on {calibrated['prompts']} prompts: temperature {calibrated['temperature']:g}, "
                  f"scale {calibrated['scale']:g} (next-token KL from full {calibrated['kl']:.4g} nats, modular's "
                  f"{calibrated['modular_kl']:.4g}); saved in {calibrated['saved']}")
        print(report)
    return 0


def _read_questions(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PCRagError(f"--questions {path}: no such file") from None
    except UnicodeDecodeError:
        raise PCRagError(f"--questions {path}: not UTF-8 text") from None
    questions = [line.strip() for line in text.splitlines() if line.strip()]
    if not questions:
        raise PCRagError(f"--questions {path}: no questions in it (one per line)")
    return questions


def _read_prompts(path: Path, plain: bool) -> list:
    import json

    from .check import rag_prompt

    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PCRagError(f"--prompts {path}: no such file") from None
    except UnicodeDecodeError:
        raise PCRagError(f"--prompts {path}: not UTF-8 text") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError:
            raise PCRagError(f"--prompts {path}:{n}: not JSON; write one JSON string or object per line") from None
        if isinstance(value, str) and value.strip():
            prompts.append(value)
            continue
        if not isinstance(value, dict) or not isinstance(value.get("question"), str) or not value["question"].strip():
            raise PCRagError(f"--prompts {path}:{n}: expected a non-empty string or an object with a \"question\" "
                             f"string (and optional \"system\" string, \"documents\" list of strings)")
        extra = set(value) - {"system", "documents", "question"}
        docs, system = value.get("documents", []), value.get("system", "")
        if extra or not isinstance(system, str) or not isinstance(docs, list) or \
                not all(isinstance(d, str) and d.strip() for d in docs):
            raise PCRagError(f"--prompts {path}:{n}: an object holds \"question\" (a string), optional \"system\" "
                             f"(a string) and \"documents\" (non-empty strings), nothing else"
                             + (f"; unknown: {', '.join(sorted(extra))}" if extra else ""))
        prompts.append(rag_prompt(docs, value["question"], system, plain))
    if not prompts:
        raise PCRagError(f"--prompts {path}: no prompts in it (one JSON value per line)")
    return prompts


def _stats(args, _extra) -> int:
    import json

    from .align import CALIBRATION_DIR
    from .store import block_files

    cache_dir = _cache_dir(args)
    blocks = block_files(cache_dir)
    embeddings = _files(cache_dir / "embeddings", "*.npy")
    models = sorted(p.name for p in (cache_dir / "models").glob("*") if p.is_dir())
    calibrations = sorted((cache_dir / CALIBRATION_DIR).glob("ape-*.json"))
    info = {
        "cache_dir": str(cache_dir),
        "kv_entries": len(blocks),
        "kv_bytes": sum(s for _, s in blocks),
        "embedding_files": len(embeddings),
        "embedding_bytes": sum(s for _, s in embeddings),
        "models": models,
        "ape_calibrations": len(calibrations),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"cache folder: {cache_dir}{'' if cache_dir.is_dir() else ' (does not exist yet)'}")
    print(f"KV blocks:    {info['kv_entries']} entries, {_size(info['kv_bytes'])} on disk")
    print(f"embeddings:   {info['embedding_files']} files, {_size(info['embedding_bytes'])}")
    print(f"models:       {', '.join(models) if models else 'none built'}")
    print(f"APE calibrations: {len(calibrations)} (pc-rag check --calibrate-ape)")
    return 0


def _clear(args, _extra) -> int:
    from .align import CALIBRATION_DIR
    from .store import BLOCKS_DIR, DiskStore, block_files

    cache_dir = _cache_dir(args)
    if not cache_dir.is_dir():
        print(f"nothing to clear: {cache_dir} does not exist")
        return 0
    blocks = block_files(cache_dir)
    if (cache_dir / BLOCKS_DIR).is_dir():  # else opening a DiskStore would create the subfolder, to clear nothing
        DiskStore(cache_dir, max_bytes=1 << 62).clear()  # a bound no folder reaches: opening it evicts nothing
    print(f"removed {len(blocks)} KV blocks ({_size(sum(s for _, s in blocks))}) from {cache_dir}")
    if args.all:
        for sub in ("embeddings", "models", CALIBRATION_DIR):
            if (cache_dir / sub).is_dir():
                shutil.rmtree(cache_dir / sub)
                print(f"removed {cache_dir / sub}")
        if (cache_dir / PUBLIC_DOCUMENTS).is_file():
            (cache_dir / PUBLIC_DOCUMENTS).unlink()
            print(f"removed {cache_dir / PUBLIC_DOCUMENTS}")
    return 0


def _serve(args, _extra) -> int:
    try:
        from .serve import ServerSettings, run
        from .serve.auth import gather_keys, is_loopback
    except ImportError as e:
        raise ImportError(f"{e.name or e} is missing: pc-rag serve needs the serve extra (pip install "
                          f"\"pc-rag[serve]\")") from e
    for name in ("port", "max_waiting", "default_max_tokens"):
        if getattr(args, name) < (0 if name == "max_waiting" else 1):
            raise PCRagError(f"--{name.replace('_', '-')} must be >= {0 if name == 'max_waiting' else 1}")
    if args.max_running is not None and args.max_running < 1:
        raise PCRagError("--max-running must be >= 1")
    for name in ("max_body_bytes", "max_prompt_chars", "max_prompt_parts", "read_timeout", "prefill_timeout",
                 "ttft_limit"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise PCRagError(f"--{name.replace('_', '-')} must be > 0")
    if any(not k.strip() for k in args.api_key or ()):
        raise PCRagError("--api-key is empty; give a key, or leave it out for no auth")
    keys = gather_keys(args.api_key or (), args.api_keys)  # a malformed key file fails before the model loads
    allowed = None
    if is_loopback(args.host) and not keys:
        allowed = ServerSettings.loopback_hosts(tuple(args.allowed_host or ()))
    elif args.allowed_host:
        allowed = frozenset(h.lower() for h in args.allowed_host)
    cache_dir = _cache_dir(args)
    public = public_documents(cache_dir)  # a damaged list stops the server before the model loads
    engine, path, _ = _in_own_thread(lambda: _checked(*_engine(args, cache_dir)))
    engine.register(public, public=True)
    engine.passages_from_first_sight = args.passages_from_first_sight
    name = args.served_model_name or (Path(path).name if Path(path).exists() else path)
    given = {k: v for k, v in (("max_body_bytes", args.max_body_bytes), ("max_prompt_chars", args.max_prompt_chars),
                               ("max_prompt_parts", args.max_prompt_parts), ("read_timeout_s", args.read_timeout),
                               ("prefill_timeout_s", args.prefill_timeout), ("ttft_limit_s", args.ttft_limit))
             if v is not None}
    settings = ServerSettings(model_id=name, api_keys=tuple(keys), allowed_hosts=allowed,
                              max_running=args.max_running or engine.max_batch, max_waiting=args.max_waiting,
                              queue_timeout_s=args.queue_timeout, default_max_tokens=args.default_max_tokens,
                              shared_cache=args.shared_cache, **given)
    if not is_loopback(args.host) and not keys:
        print(f"pc-rag serve: warning: listening on {args.host} with no API key: anyone who can reach this "
              f"port can use the model", file=sys.stderr)
    cache = ("no keys: one tenant, one cache" if not keys else "one cache for every tenant (--shared-cache)"
             if args.shared_cache else "each tenant's cache its own")
    print(f"pc-rag serve: {name} on http://{args.host}:{args.port} (OpenAI API under /v1); {cache}, "
          f"{len(public)} public documents", file=sys.stderr, flush=True)
    run(engine, settings, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _checked(engine, *rest):
    """(engine, *rest), the model's relocation self-check run now, while loading: otherwise the first modular
    request would run it (one probe forward, 0.07 to 0.34 s on the bench model here) inside its prefill deadline.
    A model that fails it serves exact and full only (those requests say why); this says it once at start."""
    try:
        engine.runner.check_relocation()
    except UnsupportedModelError as e:
        print(f"pc-rag serve: warning: {e}", file=sys.stderr, flush=True)
    return (engine, *rest)


def _in_own_thread(fn):
    """fn() run in a thread that exits when it returns. A thread that ran torch's parallel ops keeps an OpenMP
    team for as long as it lives; the model loaded on the main thread (idle under the event loop afterwards)
    slowed the request threads' forward passes by a third on the 2-core machine (see Engine.shares_steps)."""
    result: list = []

    def call():
        try:
            result.append((True, fn()))
        except BaseException as e:  # re-raised on the calling thread
            result.append((False, e))

    thread = threading.Thread(target=call, name="pc_rag-load")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


def _bench(_args, extra) -> int:
    """`python -m benchmarks.ttft ARGS` (the benchmarks run as modules of the `benchmarks` package)."""
    if not (_BENCHMARKS / "ttft.py").is_file():
        raise PCRagError(f"{_BENCHMARKS} is not in this install; run `pc-rag bench` from a source checkout of pc_rag")
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = ["benchmarks.ttft", *extra]
    sys.path.insert(0, str(_BENCHMARKS.parent))
    try:
        runpy.run_module("benchmarks.ttft", run_name="__main__", alter_sys=True)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


# ---- helpers ---------------------------------------------------------------------------------------------
def _files(folder: Path, pattern: str) -> list[tuple[Path, int]]:
    if not folder.is_dir():
        return []
    return [(p, p.stat().st_size) for p in folder.glob(pattern) if p.is_file()]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _quiet_transformers() -> None:
    """Per-file 'Loading weights' bars from transformers would drown the demo's table."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
