"""What README.md and docs/ show exists: each command and flag, each script, each Python example's imports, each file and
link they name.

The commands' flags are checked against the help that `--help` prints, made in this process by fire from each command's
`main` (one import per command, not one process each), so the test takes a few seconds. Scripts are read, not run.
"""

import ast
import importlib
import inspect
import re
import shlex
import tomllib

import fire.helptext
import fire.trace

from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Names of the form llama-* that are not this project's commands: the package, llama.cpp's tools and its binding.
NOT_OURS = {"llama-kv", "llama-cpp-python", "llama-quantize"}
COMMAND = re.compile(r"^llama-[a-z][a-z-]*$")


def entry_points() -> dict:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


def fenced_blocks(text: str):
    """(language, body) of each ``` block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def inline_code(text: str):
    without_blocks = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", without_blocks)


def shell_commands(page):
    """Every shell command the page shows: the lines of its non-Python code blocks and its inline code, each split into
    its words (comments dropped) and at `&&`, `|` and `;`."""
    text = page.read_text()
    lines = []
    for language, body in fenced_blocks(text):
        if language != "python":
            lines += body.replace("\\\n", " ").splitlines()
    lines += inline_code(text)
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # not a command (a message with an odd quote)
            continue
        command = []
        for word in words + ["&&"]:
            if word in ("&&", "|", ";"):
                if command:
                    yield line, command
                command = []
            else:
                command.append(word.strip("[]"))


def invocations():
    """(page, line, program, its arguments) for each llama-* command and each `python FILE.py` the pages show."""
    found = []
    for page in PAGES:
        for line, words in shell_commands(page):
            for i, word in enumerate(words):
                if COMMAND.match(word) and word not in NOT_OURS:
                    found.append((page.name, line, word, words[i + 1:]))
                    break
                if word.endswith(".py") and words[0] in ("python", "torchrun") and not words[i - 1].startswith("-"):
                    found.append((page.name, line, word, words[i + 1:]))
                    break
    return found


def flags(arguments):
    return [a.split("=", 1)[0] for a in arguments if a.startswith("-") and a != "-" and not a[1:2].isdigit()]


def fire_help(main, name: str) -> str:
    """What `name --help` prints: fire's help text for the command's `main`."""
    return fire.helptext.HelpText(main, trace=fire.trace.FireTrace(main, name=name))


def accepted(flag: str, help_text: str, bools) -> bool:
    """Whether fire takes `flag` for a `main` whose help is `help_text`: `--max-gen-len` as --max_gen_len, `-m` as
    --model, and `--noX` for a switch X."""
    if flag in ("--help", "--debug"):
        return True
    if flag == "-m":
        return "--model" in help_text
    name = flag.lstrip("-").replace("-", "_")
    if f"--{name}=" in help_text or f"--{name}\n" in help_text:
        return True
    return name.startswith("no") and name[2:] in bools


def main_parameters(path):
    """The parameters of a script's fire `main` (read from its source, not run), and which of them are switches; None
    where the script has no `main`."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            args = node.args.args + node.args.kwonlyargs
            defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults
            defaults += node.args.kw_defaults
            bools = {a.arg for a, d in zip(args, defaults) if isinstance(d, ast.Constant) and isinstance(d.value, bool)}
            if node.args.kwarg:  # `**overrides`: fire passes any other flag through
                return {"*"} | {a.arg for a in args}, bools
            return {a.arg for a in args}, bools
    return None, set()


def test_the_pages_show_commands():
    programs = {program for _, _, program, _ in invocations()}
    assert {"llama-generate", "llama-server", "llama-chat"} <= programs
    assert any(p.startswith("scripts/") for p in programs) and "example_text_completion.py" in programs


def test_every_command_and_flag_shown_exists():
    commands = entry_points()
    helps, problems = {}, []
    for page, line, program, arguments in invocations():
        if not program.startswith("llama-"):
            continue
        if program not in commands:
            problems.append(f"{page}: `{line}`: no command {program}")
            continue
        if program not in helps:
            main = importlib.import_module(commands[program]).main
            text = fire_help(main, program)
            assert "FLAGS" in text or "POSITIONAL ARGUMENTS" in text, text
            bools = {n for n, p in inspect.signature(main).parameters.items() if isinstance(p.default, bool)}
            helps[program] = (text, bools)
        text, bools = helps[program]
        for flag in flags(arguments):
            if not accepted(flag, text, bools):
                problems.append(f"{page}: `{line}`: {program} has no flag {flag}")
    assert not problems, "\n".join(problems)


def test_every_script_and_its_flags_exist():
    problems = []
    for page, line, program, arguments in invocations():
        if not program.endswith(".py"):
            continue
        path = REPO / program
        if not path.is_file():
            problems.append(f"{page}: `{line}`: no file {program}")
            continue
        params, bools = main_parameters(path)
        source = path.read_text()
        for flag in flags(arguments):
            name = flag.lstrip("-").replace("-", "_")
            if not params:  # no fire `main`: argparse or the like, whose flags are strings in the source
                ok = f'"{flag}"' in source
            else:
                ok = name in params or "*" in params or (name.startswith("no") and name[2:] in bools)
            if not ok:
                problems.append(f"{page}: `{line}`: {program} has no flag {flag}")
    assert not problems, "\n".join(problems)


def test_every_python_example_imports():
    examples = [(page.name, body) for page in PAGES for language, body in fenced_blocks(page.read_text())
                if language == "python"]
    assert examples
    for page, body in examples:
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{page}: {node.module} has no {alias.name}"


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_and_named_file_exists():
    problems = []
    named = re.compile(r"\b((?:llama|scripts|tests|data|docs)/[\w./-]*\w)")
    for page in PAGES:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                problems.append(f"{page.name}: link to {target}: no such file")
            elif anchor:
                headings = re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)
                if anchor not in {slug(h) for h in headings}:
                    problems.append(f"{page.name}: link to {target}: no such heading")
        for path in set(named.findall(text)):
            if path.startswith("docs/bench") and page.parent.name == "docs":
                continue  # a command's output folder, as seen from the repository root (checked below)
            if not (REPO / path).exists():
                problems.append(f"{page.name}: names {path}, which does not exist")
    assert (REPO / "docs/bench/bench.png").exists() and (REPO / "docs/bench-compiled/bench.png").exists()
    assert not problems, "\n".join(problems)


def test_every_module_the_architecture_page_names_exists():
    text = (REPO / "docs" / "architecture.md").read_text()
    modules = set(re.findall(r"\bllama/[\w/]+\.py\b", text))
    packages = set(re.findall(r"`(llama/\w+)`", text))
    assert modules and packages
    missing = [m for m in sorted(modules | packages) if not (REPO / m).exists()]
    assert not missing, missing


def test_the_pages_tell_no_history():
    """Figures are current and dated; how they came about belongs in git, not in a user's document."""
    past = re.compile(r"before this change|\bissues? \d|\bsessions? of \d|(this|a later|the next|the previous) session"
                      r"|in a later run|the run before|\bsince (main at )?[0-9a-f]{7}\b|\bhave since\b", flags=re.I)
    problems = [f"{page.name}: {m.group(0)!r}" for page in PAGES for m in past.finditer(page.read_text())]
    assert not problems, "\n".join(problems)


def test_the_readme_is_a_first_screen():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "python -m pytest\n" in readme and 'python -m pytest -m "not slow"' in readme
    assert readme.count("| measure |") == 1  # one benchmark table


def docstring_flags(main) -> dict:
    """Each flag of a command's `main` with the text its docstring's Args section gives it, continuation lines joined."""
    doc, texts, name = inspect.getdoc(main) or "", {}, None
    section = doc.split("Args:\n", 1)[1] if "Args:\n" in doc else ""
    for line in section.splitlines():
        if not line.startswith(" "):  # the section's end: an empty line or the next heading
            break
        entry = re.match(r"^ {4}(\w+)(?: \([^)]*\))?: (.*)$", line)
        if entry:
            name = entry.group(1)
            texts[name] = entry.group(2)
        elif name is not None:
            texts[name] += " " + line.strip()
    return texts


def test_every_flags_help_renders_whole():
    """fire reads a docstring's Args itself; a colon in a wrapped line can make it drop words from the middle of a
    flag's help. Each command's `--help` shows every flag's whole text."""
    problems = []
    for program, module in entry_points().items():
        main = importlib.import_module(module).main
        shown = " ".join(fire_help(main, program).split())
        texts = docstring_flags(main)
        assert texts, f"{program}: no flags read from main's docstring"
        for name, text in texts.items():
            if " ".join(text.split()) not in shown:
                problems.append(f"{program} --{name}: {text!r} is not shown whole")
    assert not problems, "\n".join(problems)
