"""Loading the model the way every command does: flags in, a ready Llama out."""

import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from llama.cli.common import as_flags, fail
from llama.cli.printer import ProgressPrinter
from llama.convert.cache import resolve_checkpoint
from llama.runtime.devices import resolve_device
from llama.convert.fetch import default_model_dir
from llama.errors import LlamaError, first_line
from llama.generation import Llama
from llama.runtime.distributed import launched_rank
from llama.runtime.progress import Progress
from llama.run_plan import ModelFlags


def default_ckpt_dir() -> str:
    """The default model's checkpoint directory, fetched and converted on first use (progress on stderr)."""
    return str(default_model_dir(fetch=True, progress=ProgressPrinter(prefix="llama-download: ")))


def build_from_flags(flags: ModelFlags) -> Llama:
    """`Llama.from_flags` as every command loads: the default model where no checkpoint is given, a GGUF file or Hugging
    Face folder converted first (saying so), a progress bar for big checkpoints, and the load's notes on stderr."""
    ckpt_dir = converted(flags.ckpt_dir) if flags.ckpt_dir is not None else None
    if flags.compile is True and resolve_device(flags.device).type != "cpu":
        # On the CPU the step comes from a stored package, and building one reports itself (llama/compile/aot.py).
        print("compiling the decode step (--compile): one to two minutes the first time, seconds once Inductor "
              "has it cached on disk", file=sys.stderr, flush=True)
    llama = Llama.from_flags(
        replace(flags, ckpt_dir=ckpt_dir if ckpt_dir is not None else default_ckpt_dir()),
        # Under torchrun every rank loads alike: rank 0's reports stand for all.
        progress=_progress(ckpt_dir) if launched_rank() == 0 else None,
    )
    if is_main_rank(llama):  # every rank loads alike; one copy of each note is enough
        for note in llama.info.notes:
            print(f"note: {as_flags(note)}", file=sys.stderr, flush=True)
    return llama


def _progress(ckpt_dir: Optional[str]) -> Progress:
    """The loading bar for big checkpoints only; a first build of the integer kernels always says so."""
    printer, big = ProgressPrinter(), _is_big(ckpt_dir)

    def report(what: str, done: int, total: int) -> None:
        if big or what != "loading weights":
            printer(what, done, total)

    return report


def converted(ckpt_dir: str) -> str:
    """A checkpoint directory for --ckpt-dir: a GGUF file or Hugging Face folder is converted once into
    $LLAMA_HOME/converted (llama/convert/cache.py), saying where, how much disk it takes and how it goes."""
    if launched_rank() != 0:  # under torchrun every rank resolves alike; rank 0 speaks for all
        return str(resolve_checkpoint(ckpt_dir))
    say = lambda line: print(f"llama-convert: {line}", file=sys.stderr, flush=True)  # noqa: E731
    return str(resolve_checkpoint(ckpt_dir, ProgressPrinter(prefix="llama-convert: "), say))


def _is_big(ckpt_dir: Optional[str]) -> bool:
    """Whether loading takes long enough (over a GB of weights) to be worth a progress bar."""
    if ckpt_dir is None:
        return False
    return sum(p.stat().st_size for p in Path(ckpt_dir).glob("consolidated.*.pth")) > 2**30


def check_draft_flags(speculate: Optional[str], draft_model: Optional[str], draft_quantize: Optional[str],
                      draft_tokens: int, kv_cache: bool) -> None:
    """Refuse, before loading anything, speculation asked for in a way that cannot run."""
    from llama.speculative import check_speculation

    try:
        check_speculation(speculate or (None if draft_model is None else "ngram"), draft_tokens, kv_cache)
    except LlamaError as e:
        fail(as_flags(str(e)))
    if draft_model is not None and speculate is not None:
        fail("--speculate ngram and --draft-model are two ways to draft; give one")
    if draft_quantize is not None and draft_model is None:
        fail("--draft-quantize quantizes the draft model: give it with --draft-model PATH (the model's own "
             "checkpoint gives an int4 copy of it: --draft-model MODEL --draft-quantize int4)")


def controls_from_flags(repeat_penalty, repeat_last_n, top_k, min_p, speculating: bool):
    """The `SamplingControls` the flags ask for (None where they change nothing), or a one-line error for a value out
    of range or a control together with speculation."""
    from llama.sampling import SamplingControls, check_controls

    for flag, value, kinds in (("--repeat-penalty", repeat_penalty, (int, float)), ("--repeat-last-n", repeat_last_n, int),
                               ("--top-k", top_k, int), ("--min-p", min_p, (int, float))):
        if isinstance(value, bool) or not isinstance(value, kinds):
            fail(f"{flag} takes a {'whole ' if kinds is int else ''}number, not {value!r}")
    controls = SamplingControls(repeat_penalty=float(repeat_penalty), repeat_last_n=repeat_last_n, top_k=top_k,
                                min_p=float(min_p))
    try:
        check_controls(controls, vocab_size=0)
    except LlamaError as e:
        fail(re.sub(r"\b(repeat_penalty|repeat_last_n|top_k|min_p)\b", lambda m: "--" + m.group(1).replace("_", "-"),
                    str(e)))
    if not controls.active:
        return None
    if speculating:
        fail("--repeat-penalty, --top-k and --min-p cannot be used with --speculate or --draft-model; leave out one or "
             "the other")
    return controls


def grammar_from_flags(json_schema, grammar, speculating: bool):
    """The `Grammar` that --json-schema (a file or the JSON itself) or --grammar (a file) asks for, None for neither,
    or a one-line error."""
    from llama.constraint import Grammar

    if json_schema is None and grammar is None:
        return None
    if json_schema is not None and grammar is not None:
        fail("--json-schema and --grammar each constrain the reply; give one of them")
    if speculating:
        fail("--json-schema and --grammar cannot be used with --speculate or --draft-model; leave out one or the other")
    try:
        if grammar is not None:
            if not isinstance(grammar, str) or not Path(grammar).is_file():
                fail(f"--grammar takes a file with a Lark or GBNF grammar; {grammar!r} is not a file")
            return Grammar.from_text(read_text_file(Path(grammar), "--grammar"))
        if not isinstance(json_schema, str):  # the flag with no value (True)
            fail("--json-schema takes a file or the schema's JSON, e.g. --json-schema '{\"type\": \"object\"}'")
        if Path(json_schema).is_file():
            json_schema = read_text_file(Path(json_schema), "--json-schema")
        elif not json_schema.lstrip().startswith("{"):
            fail(f"--json-schema takes a file or the schema's JSON; {json_schema!r} is neither")
        return Grammar.json_schema(json_schema)
    except LlamaError as e:
        fail(str(e))


def read_text_file(path: Path, flag: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{flag}: cannot read {path}: {e}")


def check_grammar(grammar, llama: Llama) -> None:
    """A one-line error where the grammar cannot be compiled against the model's vocabulary."""
    if grammar is not None:
        try:
            grammar.check(llama.tokenizer)
        except LlamaError as e:
            fail(str(e))


def speculation_from_flags(llama: Llama, flags: ModelFlags, speculate: Optional[str], draft_model: Optional[str],
                           draft_quantize: Optional[str], draft_tokens: int):
    """What `Llama.generate(speculate=...)` takes for the flags: None, "ngram", or a `DraftModel` over the draft
    checkpoint, loaded as the model was (its `flags`; the default model where `--draft-model default`). The compiled
    steps it runs on are ready when this returns."""
    if draft_model is None and speculate is None:
        return None
    _ready_to_speculate(llama, (1, draft_tokens + 1))
    if draft_model is None:
        return speculate
    from llama.speculative import DraftModel

    path = None if str(draft_model) == "default" else str(draft_model)
    draft = build_from_flags(replace(flags, ckpt_dir=path, tokenizer_path=None, max_seq_len=llama.model.params.max_seq_len,
                                     max_batch_size=1, seed=1, quantize=draft_quantize, kv_cache_dtype=None,
                                     compile_batch_size=1, compile_layers=None))
    _ready_to_speculate(draft)
    try:
        return DraftModel(draft, llama)
    except LlamaError as e:
        fail(str(e))


def _ready_to_speculate(llama: Llama, *sizes) -> None:
    """Load, or build now, the stored steps speculation runs on: the one-token step and the step that checks a draft
    (`sizes`). Left to the background, as the plain decode's default leaves its step, a first run would speculate
    only once both were built, and meanwhile run slower than the plain decode; a build is said on stderr."""
    step = llama.compiled_step
    ahead = step.ahead_of_time if step is not None else None
    if ahead is None:
        return
    try:
        for size in (1, *sizes):
            ahead.runner(size)
    except Exception as e:  # Unsupported, or Inductor's failures: the steps it lacks run eagerly
        if is_main_rank(llama):
            print(f"note: the compiled steps for speculating could not be had ({first_line(e)}); "
                  "drafts are checked eagerly", file=sys.stderr, flush=True)


def describe_speculation(speculate: Optional[str], draft_model: Optional[str], draft_quantize: Optional[str],
                         draft_tokens: int) -> str:
    """--stats' words for how drafts were made: "ngram, drafts of up to 4 tokens"."""
    how = speculate if draft_model is None else \
        f"draft model {draft_model}" + (f" ({draft_quantize})" if draft_quantize else "")
    return f"{how}, drafts of up to {draft_tokens} tokens"


def is_main_rank(llama: Llama) -> bool:
    """Under torchrun every rank computes the same tokens; only rank 0 prints them."""
    return llama.info.rank == 0
