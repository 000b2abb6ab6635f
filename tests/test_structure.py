"""The module map and its conventions (docs/architecture.md): the table of contents in rlhf.py's docstring
matches the section banners and lists every public name in the section that defines it, and the safety
conventions hold."""

from __future__ import annotations

import ast
import bisect
import dataclasses
import functools
import inspect
import json
import re
import typing
from pathlib import Path

import pytest

import rlhf

TOC_SECTION = re.compile(r"^  (\d+)\. (.+)$")
TOC_NAMES = re.compile(r"^ {7}(?!add: )(\S.*)$")
BANNER = re.compile(r"^# ==== (\d+)\. (.+) ====$")
MODULES = ("rlhf.py", "inference_optimizations.py", "model_merging.py")


def _toc_sections() -> list[tuple[int, str, list[str], str]]:
    """(number, title, names, add clause) per section: a ``  N. Title`` line, then its names (comma-separated,
    indented 7), then an ``add:`` clause (indented 7, continued at 12) that ends the names."""
    doc = rlhf.__doc__ or ""
    start = doc.index("Table of contents")
    entries: list[tuple[int, str, list[str], list[str]]] = []
    for line in doc[start:].splitlines()[1:]:
        if match := TOC_SECTION.match(line):
            entries.append((int(match[1]), match[2], [], []))
        elif entries and (line.strip().startswith("add: ") or (entries[-1][3] and line.startswith(" " * 12))):
            entries[-1][3].append(line.strip())
        elif entries and not entries[-1][3] and (match := TOC_NAMES.match(line)):
            entries[-1][2].extend(name.strip() for name in match[1].split(",") if name.strip())
        elif entries:
            break
    return [(number, title, names, " ".join(add)) for number, title, names, add in entries]


def table_of_contents() -> list[tuple[int, str, list[str]]]:
    return [(number, title, names) for number, title, names, _ in _toc_sections()]


def banners(source: str) -> list[tuple[int, str, int]]:
    """(number, title, line index) of every section banner."""
    return [(int(m[1]), m[2], i) for i, line in enumerate(source.splitlines()) if (m := BANNER.match(line))]


@pytest.fixture(scope="module")
def source(repo) -> str:
    return (repo / "rlhf.py").read_text(encoding="utf-8")


def test_toc_matches_banners(source):
    toc = table_of_contents()
    assert toc, "the module docstring has no table of contents"
    assert [(n, t) for n, t, _ in toc] == [(n, t) for n, t, _ in banners(source)]


def test_sections_are_in_order(source):
    numbers = [n for n, _, _ in banners(source)]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    assert numbers[0] == 0


def test_toc_names_exist():
    missing = [(n, name) for n, _, names in table_of_contents() for name in names if not hasattr(rlhf, name)]
    assert not missing


def test_toc_names_are_public():
    assert all(not name.startswith("_") for _, _, names in table_of_contents() for name in names)


def top_level_definitions(tree: ast.Module) -> dict[str, int]:
    """Name -> 0-based line of its module-level def/class/assignment (imports are left out)."""
    found: dict[str, int] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.setdefault(node.name, node.lineno - 1)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, node.lineno - 1)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found.setdefault(node.target.id, node.lineno - 1)
    return found


def test_toc_names_live_in_their_section(source):
    """Each listed name is defined between its section's banner and the next one (or imported)."""
    lines = source.splitlines()
    found = banners(source)
    ranges = {n: (start, found[i + 1][2] if i + 1 < len(found) else len(lines))
              for i, (n, _, start) in enumerate(found)}
    definitions = top_level_definitions(_parsed(rlhf.__file__))
    misplaced = []
    for number, _, names in table_of_contents():
        start, end = ranges[number]
        for name in names:
            line = definitions.get(name)
            if line is None:
                assert getattr(rlhf, name).__module__ != "rlhf", f"{name} is neither defined nor imported"
            elif not start < line < end:
                misplaced.append((number, name, line + 1))
    assert not misplaced


def test_toc_lists_every_public_class_and_function(source):
    """Every public class and function rlhf.py defines is in the table of contents, under its own section (the
    placement test above checks the section), and every section says what a contributor adds there."""
    listed = {name for _, _, names in table_of_contents() for name in names}
    tree = _parsed(rlhf.__file__)
    public = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
              and not node.name.startswith("_")]
    assert not [name for name in public if name not in listed]
    assert all(add.startswith("add: ") and len(add) > 10 for _, _, _, add in _toc_sections())


def test_no_file_cites_a_map_outside_the_repository(repo):
    """The map is docs/architecture.md; the design document beside the project is not in a clone."""
    outside_map = "DESIGN" + ".md"
    cited = [str(path.relative_to(repo)) for pattern in ("*.py", "tests/*.py", "docs/**/*.md", "*.md")
             for path in repo.glob(pattern) if outside_map in path.read_text(encoding="utf-8")]
    assert not cited
    assert (repo / "docs" / "architecture.md").exists()


def test_imported_toc_names_come_from_sibling_modules():
    import inference_optimizations

    for _, _, names in table_of_contents():
        for name in names:
            obj = getattr(rlhf, name)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ != "rlhf":
                assert getattr(inference_optimizations, name, None) is obj or obj.__module__ == "model_merging"


# ---------------------------------------------------------------- docs/architecture.md conventions


@functools.cache
def _parsed(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(encoding="utf-8"), filename=path)


def _tree(repo, name: str) -> ast.Module:
    return _parsed(str(repo / name))


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def _is_torch_load(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name)
            and node.value.id == "torch")


@pytest.mark.parametrize("name", MODULES)
def test_torch_load_only_with_weights_only(repo, name):
    tree = _tree(repo, name)
    safe_calls = set()
    offending = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_torch_load(node.func):
            value = {k.arg: k.value for k in node.keywords}.get("weights_only")
            if isinstance(value, ast.Constant) and value.value is True:
                safe_calls.add(id(node.func))
            else:
                offending.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "load" for a in node.names):
            offending.append(node.lineno)
    # any other reference (``load = torch.load``, ``functools.partial(torch.load, ...)``) is suspicious too
    offending += [n.lineno for n in ast.walk(tree) if _is_torch_load(n) and id(n) not in safe_calls
                  and n.lineno not in offending]
    assert not offending, f"{name}: torch.load without weights_only=True at lines {sorted(offending)}"


@pytest.mark.parametrize("name", MODULES)
def test_no_pickle(repo, name):
    assert not _imports(_tree(repo, name)) & {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib"}


@pytest.mark.parametrize("name", ["inference_optimizations.py", "model_merging.py"])
def test_sibling_modules_do_not_import_rlhf(repo, name):
    assert "rlhf" not in _imports(_tree(repo, name))


def test_trust_remote_code_defaults_false(repo):
    import dataclasses

    assert rlhf.BaseConfig().trust_remote_code is False
    assert next(f for f in dataclasses.fields(rlhf.SFTConfig) if f.name == "trust_remote_code").default is False
    # every function that takes trust_remote_code defaults it to False
    for name in MODULES:
        for node in ast.walk(_tree(repo, name)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                positional = args.posonlyargs + args.args
                defaults = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]], args.defaults))
                defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None}
                names = [a.arg for a in positional + args.kwonlyargs]
                if "trust_remote_code" in names:
                    default = defaults.get("trust_remote_code")
                    assert isinstance(default, ast.Constant) and default.value is False, (name, node.name)


def test_no_assert_statements(repo):
    """docs/architecture.md: raise on user input, never ``assert`` (asserts vanish under ``python -O``)."""
    tree = _tree(repo, "rlhf.py")
    asserts = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not asserts, f"assert statements in rlhf.py at lines {asserts}"


# ---------------------------------------------------------------- stages: one registered slice each


def test_every_stage_is_one_registered_slice(source):
    """Each registered stage's config, trainer and runner are defined in the Trainers section below one reading map
    that names them, its config's ``stage`` is its name, and every list of stages the pipeline reads is a view of
    STAGES."""
    lines = source.splitlines()
    definitions = top_level_definitions(_parsed(rlhf.__file__))
    found = banners(source)
    trainers = next(k for k, (_, title, _) in enumerate(found) if title == "Trainers")
    start, end = found[trainers][2], found[trainers + 1][2]
    assert list(rlhf.STAGES) == list(rlhf.STAGE_CONFIGS) == list(rlhf.STAGE_RUNNERS) == list(rlhf.STAGE_RECORD_KINDS)
    for name, stage in rlhf.STAGES.items():
        assert stage.config.stage == name
        assert rlhf.STAGE_CONFIGS[name] is stage.config and rlhf.STAGE_RUNNERS[name] is stage.runner
        assert rlhf.STAGE_RECORD_KINDS[name] == stage.record_kind in rlhf.RECORD_KINDS
        assert (name in rlhf.POLICY_STAGES) == stage.makes_policy
        assert (name in rlhf.POLICY_OPTIMISATION_STAGES) == stage.optimises_policy
        config_line = definitions[stage.config.__name__]
        assert start < config_line < end, f"{stage.config.__name__} is not in the Trainers section"
        header = max(i for i in range(start, config_line) if lines[i].startswith("# ---- "))
        reading_map = "\n".join(line for line in lines[header:config_line] if line.startswith("#   "))
        for part in (stage.config.__name__, stage.trainer.__name__, stage.runner.__name__, "register_stage"):
            assert part in reading_map, f"the reading map above {stage.config.__name__} does not name {part}"
        assert header < definitions[stage.runner.__name__] < end
    assert tuple(rlhf.POLICY_STAGES) == tuple(n for n, s in rlhf.STAGES.items() if s.makes_policy)


def test_training_stage_is_the_enum_of_registered_stages_and_prints_as_its_name():
    assert [s.value for s in rlhf.TrainingStage] == list(rlhf.STAGES)
    assert rlhf.TrainingStage("simpo") is rlhf.TrainingStage.SIMPO == "simpo"
    assert f"{rlhf.TrainingStage.DPO}" == str(rlhf.TrainingStage.DPO) == "dpo"
    assert json.dumps({"stage": rlhf.TrainingStage.GRPO}) == '{"stage": "grpo"}'


def test_simpo_registers_its_own_trainer(tmp_path, llama_dir, demo_dir):
    assert rlhf.STAGES["simpo"].trainer is rlhf.SimPOTrainer and issubclass(rlhf.SimPOTrainer, rlhf.DPOTrainer)
    policy = rlhf.PolicyModel.from_pretrained(str(llama_dir))
    with pytest.raises(rlhf.RLHFInputError, match="SimPOTrainer"):
        rlhf.DPOTrainer(rlhf.DPOConfig(output_dir=str(tmp_path), pref_loss="simpo"), policy, [])
    records = rlhf.load_records("demo_preference", demo_dir, "preference", max_samples=4)
    pairs = rlhf.PreferenceDataset(records, policy.tokenizer, rlhf.ChatFormatter(policy.tokenizer), cutoff_len=64)
    trainer = rlhf.SimPOTrainer(rlhf.SimPOConfig(output_dir=str(tmp_path), save_steps=0), policy, pairs)
    assert trainer.stage is rlhf.TrainingStage.SIMPO


def test_a_stage_a_user_registers_joins_every_view():
    @dataclasses.dataclass
    class EchoConfig(rlhf.SFTConfig):
        stage: typing.ClassVar[str] = "echo"

    try:
        stage = rlhf.register_stage(rlhf.Stage("echo", EchoConfig, rlhf.train_sft, rlhf.SFTTrainer, record_kind="sft"))
        assert rlhf.STAGE_CONFIGS["echo"] is EchoConfig and rlhf.STAGE_RUNNERS["echo"] is rlhf.train_sft
        assert "echo" in rlhf.POLICY_STAGES and "echo" in rlhf.POLICY_OPTIMISATION_STAGES and stage.name == "echo"
        with pytest.raises(ValueError, match="stage is 'echo'"):
            rlhf.register_stage(rlhf.Stage("other", EchoConfig, rlhf.train_sft, rlhf.SFTTrainer, record_kind="sft"))
    finally:
        rlhf.STAGES.pop("echo", None)
    assert "echo" not in rlhf.STAGE_CONFIGS


def test_templates_are_records_and_their_end_markers_are_the_engines():
    """One ChatTemplate per name; the views and inference_optimizations' END_MARKERS (which finds the same markers
    in a tokenizer's own template) agree with the records."""
    import inference_optimizations

    assert list(rlhf.CHAT_TEMPLATES) == list(rlhf.TEMPLATES)
    for name, template in rlhf.TEMPLATES.items():
        assert template.name == name and rlhf.CHAT_TEMPLATES[name] == template.jinja
        assert rlhf.TEMPLATE_SPECIAL_TOKENS[name] == template.special_tokens
        assert template.end_marker is None or template.end_marker in inference_optimizations.END_MARKERS
        assert template.end_marker is None or template.end_marker in template.jinja
        assert set(template.tools) <= {"tools", "tool calls", "tool results"}
        assert template.thinking == ("enable_thinking" in template.jinja)


# ---------------------------------------------------------------- size and direction (issue 54)

MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_class_is_longer_than_400_lines():
    """A class that outgrows a screenful of screens is several classes: split it at a seam (a helper object it holds,
    as DeviceManager holds DeepSpeedSupport and RLHFOrchestrator FinalStages)."""
    long = [(node.name, node.lineno, _length(node)) for node in ast.walk(_parsed(rlhf.__file__))
            if isinstance(node, ast.ClassDef) and _length(node) > MAX_CLASS_LINES]
    assert not long, f"classes over {MAX_CLASS_LINES} lines (name, line, length): {long}"


def test_no_function_is_longer_than_60_lines():
    long = [(node.name, node.lineno, _length(node)) for node in ast.walk(_parsed(rlhf.__file__))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _length(node) > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (name, line, length): {long}"


class _RuntimeNames(ast.NodeVisitor):
    """The names a module-level definition reads when it runs: function bodies, default values and decorators, class
    bases and bodies, assigned values. Annotations are left out: ``from __future__ import annotations`` keeps them as
    strings that nothing evaluates."""

    def __init__(self) -> None:
        self.names: list[tuple[str, int]] = []

    def visit_Name(self, node: ast.Name) -> None:  # noqa: N802 (ast's name)
        self.names.append((node.id, node.lineno))

    def visit_arg(self, node: ast.arg) -> None:  # an argument's annotation
        pass

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:  # noqa: N802
        for part in [*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d), *node.body]:
            self.visit(part)

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:  # noqa: N802
        if node.value is not None:
            self.visit(node.value)


def forward_references(source: str, tree: ast.Module) -> list[tuple[int, str, str, int, int]]:
    """(section, definition, name, the name's section, line) for each module-level definition that reads, at run
    time, a module-level name defined in a later section. Section 0's registries are filled from later sections
    the other way round (a later section names the registry), which this does not count."""
    starts = [start for _, _, start in banners(source)]
    numbers = [number for number, _, _ in banners(source)]

    def section(line: int) -> int | None:  # ``line``: 0-based
        index = bisect.bisect_right(starts, line) - 1
        return numbers[index] if index >= 0 else None

    defined = {name: section(line) for name, line in top_level_definitions(tree).items()}
    found = {}
    for node in tree.body:
        here = section(node.lineno - 1)
        visitor = _RuntimeNames()
        visitor.visit(node)
        for name, line in visitor.names:
            there = defined.get(name)
            if here is not None and there is not None and there > here:
                found.setdefault((here, getattr(node, "name", "?"), name), (there, line))
    return [(here, definition, name, there, line) for (here, definition, name), (there, line) in found.items()]


def test_no_section_refers_to_a_later_one(source):
    """docs/architecture.md: no section uses a name from a later one (but through section 0's registries, which
    later sections fill); a helper two sections need lives in the earlier one."""
    assert not forward_references(source, _parsed(rlhf.__file__))


def test_forward_references_are_found():
    source = "\n".join(["# ==== 0. First ====", "def early():", "    return LATER", "def fine(x: Later = None):",
                        "    pass", "# ==== 1. Second ====", "LATER = 1", "class Later:", "    pass"])
    assert [(s, d, n, t) for s, d, n, t, _ in forward_references(source, ast.parse(source))] == [
        (0, "early", "LATER", 1)]
