"""Structured outputs in the library (llama/constraint.py): the tokenizer's adaptor for llguidance, a grammar's mask
on the logits, and `Llama.generate(grammar=...)` keeping the switch: the same tokens cached and uncached, alone and in
a batch. A tiny random model says nothing a grammar does not force, so every check is one the grammar guarantees:
the text validates, and the runs agree."""

import builtins
import json
import sys
from pathlib import Path

import pytest
import torch

import jsonschema  # noqa: E402  (the test extra has it, and llguidance)

from helpers import EXAMPLE_TOKENIZER, FINITE_SCHEMAS, assert_one_line_error, build, generate_json, run  # noqa: E402
from llama import Grammar, LlamaError  # noqa: E402
from llama.constraint import INSTALL_HINT, Constraint, StructuredUnavailable  # noqa: E402
from llama.tokenizer import Tokenizer, token_bytes  # noqa: E402

GRAMMAR = 'root ::= "yes" | "no" | "maybe, " ("a" | "b")'


@pytest.fixture(scope="module")
def llama(nonstop_ckpt):
    return build(nonstop_ckpt, max_seq_len=512)


def encode(llama, text):
    return llama.tokenizer.encode(text, bos=True, eos=False)


@pytest.mark.parametrize("name", list(FINITE_SCHEMAS))
def test_any_walk_the_mask_allows_is_valid_json(name):
    """Tokens drawn uniformly from what the mask allows, SentencePiece's byte tokens and duplicates among them: the
    text always ends at a stop token and validates. The walk is not a model's choice, so it reaches corners no greedy
    run would."""
    tokenizer = Tokenizer(str(EXAMPLE_TOKENIZER))
    grammar = Grammar.json_schema(FINITE_SCHEMAS[name])
    for seed in range(8):
        constraint, generated = Constraint(grammar, tokenizer), []
        gen = torch.Generator().manual_seed(seed)
        while True:
            logits = constraint.mask(torch.zeros(tokenizer.n_words + 3), generated)  # 3 padding rows: masked
            assert torch.isinf(logits[tokenizer.n_words :]).all()
            token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
            if token in tokenizer.stop_ids:
                break
            generated.append(token)
            assert len(generated) < 600
        jsonschema.validate(json.loads(tokenizer.decode(generated)), FINITE_SCHEMAS[name])


def walk(tokenizer, grammar, seed):
    """Tokens drawn uniformly from what the mask allows, to a stop token: the text."""
    constraint, generated = Constraint(grammar, tokenizer), []
    gen = torch.Generator().manual_seed(seed)
    while True:
        logits = constraint.mask(torch.zeros(tokenizer.n_words), generated)
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if token in tokenizer.stop_ids:
            return tokenizer.decode(generated)
        generated.append(token)
        assert len(generated) < 2000


@pytest.mark.slow  # LLaMA-2's vocabulary (fetched once), and the default model's
@pytest.mark.parametrize("which", ["llama2", "smollm2"])
def test_real_vocabularies_walk_to_valid_json(which):
    """LLaMA-2's SentencePiece vocabulary (32,000 pieces, byte fallback) and SmolLM2's byte-level BPE one (49,152,
    ChatML's special tokens): every walk the mask allows validates."""
    if which == "llama2":
        from llama.convert.llama2_vocab import TOKENIZER_MODEL, fetch_llama2_vocab

        tokenizer = Tokenizer(str(fetch_llama2_vocab() / TOKENIZER_MODEL))
    else:
        from llama.convert.fetch import default_model_dir

        tokenizer = Tokenizer(str(default_model_dir() / "tokenizer.json"))
    for name, schema in FINITE_SCHEMAS.items():
        for seed in range(3):
            jsonschema.validate(json.loads(walk(tokenizer, Grammar.json_schema(schema), seed)), schema)


def test_a_complete_reply_allows_only_the_stop_tokens():
    """"maybe, a" spelled by the longest tokens the mask allows at each step; then only the stop tokens are."""
    tokenizer = Tokenizer(str(EXAMPLE_TOKENIZER))
    constraint = Constraint(Grammar.from_text(GRAMMAR), tokenizer)
    generated, rest = [], b"maybe, a"
    while rest:
        allowed = torch.isfinite(constraint.mask(torch.zeros(tokenizer.n_words), generated)).nonzero()[:, 0].tolist()
        token = max((t for t in allowed if token_bytes(tokenizer, t) and rest.startswith(token_bytes(tokenizer, t))),
                    key=lambda t: len(token_bytes(tokenizer, t)))
        generated.append(token)
        rest = rest[len(token_bytes(tokenizer, token)) :]
    allowed = torch.isfinite(constraint.mask(torch.zeros(tokenizer.n_words), generated)).nonzero()[:, 0].tolist()
    assert allowed == tokenizer.stop_ids
    assert tokenizer.decode(generated) == "maybe, a"


@pytest.mark.parametrize("schema, reason", [
    ({"type": "nonsense"}, "Invalid type"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
    ({"type": "string", "pattern": "(("}, "regex"),
    ("{not json", "not valid JSON"),
])
def test_an_invalid_schema_is_a_llama_error_with_the_reason(schema, reason):
    with pytest.raises(LlamaError, match="invalid|not valid") as e:
        Grammar.json_schema(schema).check(Tokenizer(str(EXAMPLE_TOKENIZER)))
    assert reason in str(e.value) and "\n" not in str(e.value)


def test_gbnf_and_lark_grammars_are_both_read(llama):
    for text in (GRAMMAR, 'start: "yes" | "no" | "maybe, " ("a" | "b")'):
        (tokens,), _ = llama.generate([encode(llama, "Well")], 20, temperature=0.8, grammar=Grammar.from_text(text))
        assert llama.tokenizer.decode(tokens) in ("yes", "no", "maybe, a", "maybe, b")
    with pytest.raises(LlamaError, match="grammar is invalid"):
        Grammar.from_text("start: undefined_rule").check(llama.tokenizer)


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_cached_uncached_alone_and_batched_give_the_same_tokens(llama, temperature):
    """The switch under a constraint: with and without the KV cache, and a row in a batch of prompts of different
    lengths against the same row alone (greedy; sampled rows draw from one generator, so only the switch is
    compared there)."""
    grammar = Grammar.json_schema(FINITE_SCHEMAS["nested"])
    prompts = [encode(llama, "Hello"), encode(llama, "The capital of France is"), encode(llama, "a b c d e f g")]
    llama.generator.manual_seed(5)
    cached, _ = llama.generate(prompts, 400, temperature=temperature, grammar=grammar)
    llama.generator.manual_seed(5)
    uncached, _ = llama.generate(prompts, 400, temperature=temperature, grammar=grammar, kv_cache=False)
    assert cached == uncached
    for tokens in cached:
        assert len(tokens) < 400  # ended at a stop token
        jsonschema.validate(json.loads(llama.tokenizer.decode(tokens)), FINITE_SCHEMAS["nested"])
    if temperature == 0:
        for prompt, tokens in zip(prompts, cached):
            assert llama.generate([prompt], 400, temperature=0, grammar=grammar)[0][0] == tokens


def test_a_constraint_goes_before_the_sampling_controls(llama):
    """A logit_bias toward a token the grammar forbids changes nothing; toward one it allows, it is chosen."""
    from llama.sampling import SamplingControls

    grammar = Grammar.from_text('root ::= "yes" | "no"')
    prompt = encode(llama, "Well")
    allowed = torch.isfinite(Constraint(grammar, llama.tokenizer).mask(torch.zeros(llama.tokenizer.n_words), []))
    no = [t for t in allowed.nonzero()[:, 0].tolist() if token_bytes(llama.tokenizer, t).startswith(b"n")]
    for token in no:
        (toward_no,), _ = llama.generate([prompt], 8, temperature=0, grammar=grammar,
                                         controls=SamplingControls(logit_bias=((token, 100.0),)))
        assert llama.tokenizer.decode(toward_no) == "no"
    (plain,), _ = llama.generate([prompt], 8, temperature=0, grammar=grammar)
    (forbidden,), _ = llama.generate([prompt], 8, temperature=0, grammar=grammar,
                                     controls=SamplingControls(logit_bias=((1005, 100.0),)))
    assert forbidden == plain


def test_a_grammar_is_refused_with_speculation(llama):
    with pytest.raises(LlamaError, match="speculation"):
        llama.generate([encode(llama, "Hi")], 4, grammar=Grammar.json_object(), speculate="ngram")


def test_without_llguidance_the_error_says_what_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name == "llguidance":
            raise ImportError("No module named 'llguidance'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "llguidance")
    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(StructuredUnavailable) as e:
        Grammar.json_object()
    assert str(e.value) == INSTALL_HINT and 'pip install "llama-kv[structured]"' in str(e.value)


@pytest.mark.slow  # commands in subprocesses
def test_the_commands_flags(nonstop_ckpt, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(FINITE_SCHEMAS["numbers"]))
    cached = generate_json(nonstop_ckpt, "--prompt", "Hello", "--json-schema", str(schema), max_gen_len=200)[0]
    uncached = generate_json(nonstop_ckpt, "--prompt", "Hello", "--json-schema", str(schema), "--no-kv-cache",
                             max_gen_len=200)[0]
    assert cached["tokens"] == uncached["tokens"]
    jsonschema.validate(json.loads(cached["text"]), FINITE_SCHEMAS["numbers"])
    inline = generate_json(nonstop_ckpt, "--prompt", "Hello", "--json-schema", json.dumps(FINITE_SCHEMAS["numbers"]),
                           max_gen_len=200)[0]
    assert inline["tokens"] == cached["tokens"]
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text(GRAMMAR)
    r = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "Well", "--grammar", grammar,
            "--temperature", "0")
    assert r.returncode == 0 and r.stdout.strip() in ("yes", "no", "maybe, a", "maybe, b"), r.stderr
    r = run("llama-chat", "--ckpt-dir", nonstop_ckpt, "--json-schema", schema, "--temperature", "0",
            "--max-gen-len", "200", input="Hi\n")
    assert r.returncode == 0, r.stderr
    reply = r.stdout[r.stdout.index("{") : r.stdout.rindex("}") + 1]
    jsonschema.validate(json.loads(reply), FINITE_SCHEMAS["numbers"])


@pytest.mark.slow  # commands in subprocesses
def test_the_commands_mistakes_are_one_line_errors(nonstop_ckpt, tmp_path):
    r = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "Hi", "--json-schema", '{"type": "nonsense"}')
    assert_one_line_error(r, "JSON schema is invalid", "nonsense")
    r = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "Hi", "--json-schema", "missing.json")
    assert_one_line_error(r, "--json-schema takes a file or the schema's JSON")
    r = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "Hi", "--grammar", "missing.gbnf")
    assert_one_line_error(r, "--grammar takes a file")
    r = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "Hi", "--json-schema", "{}",
            "--speculate", "ngram")
    assert_one_line_error(r, "cannot be used with --speculate")
    # Without llguidance: a package of that name that cannot be imported, first on the path.
    hidden = tmp_path / "hidden" / "llguidance"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    r = run("llama-generate", "--ckpt-dir", nonstop_ckpt, "--prompt", "Hi", "--json-schema", "{}",
            env={"PYTHONPATH": f"{hidden.parent}:{Path(__file__).resolve().parents[1]}"})
    assert_one_line_error(r, 'pip install "llama-kv[structured]"')
