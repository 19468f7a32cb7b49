"""docs/reference/rewards.md: every reward function the reward service registers, from the registry itself.

The functions are ``services/reward/scores.py``'s registry (``scores.available()``); what each computes is its
factory's docstring, its parameters (type, bounds, default) the factory's signature, each described in the
docstring's ``Args:`` section; the other names a request may use are ``functions.ALIASES``, and the functions a
request may not name are ``functions.CONFIG_ONLY``. A registered function without a docstring, or a parameter
the docstring does not describe, fails the generation.
"""

from __future__ import annotations

import ast
import inspect
import re
import typing
from pathlib import Path

from ._markdown import cell, generated_banner

ROOT = Path(__file__).resolve().parents[2]
SCORES = ROOT / "services" / "reward" / "scores.py"
_ARG = re.compile(r"^(\w+): (.*)$")


def _docstring_parts(name: str, factory) -> tuple[str, dict[str, str]]:
    """(the text before ``Args:``, {parameter: its description}) of ``factory``'s docstring."""
    doc = inspect.getdoc(factory)
    if not doc:
        raise RuntimeError(f"reward function {name!r} ({factory.__qualname__} in {SCORES.relative_to(ROOT)}) has no "
                           "docstring: say what it computes and what it needs")
    text, _, args = doc.partition("\nArgs:\n")
    described: dict[str, str] = {}
    current = None
    for line in args.splitlines():
        match = _ARG.match(line.strip()) if not line.startswith("        ") else None
        if match:
            current = match.group(1)
            described[current] = match.group(2)
        elif current and line.strip():
            described[current] += " " + line.strip()
    return text.strip(), described


def _type(annotation) -> str:
    """``float ≥ 0, finite`` from ``Annotated[float, Field(ge=0, allow_inf_nan=False)]``."""
    if annotation is inspect.Parameter.empty or annotation is typing.Any:
        return ""
    bounds = []
    if typing.get_origin(annotation) is typing.Annotated:
        annotation, *metadata = typing.get_args(annotation)
        for item in metadata:
            for rule in getattr(item, "metadata", [item]):
                for attribute, symbol in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
                    if getattr(rule, attribute, None) is not None:
                        bounds.append(f"{symbol} {getattr(rule, attribute)}")
                if getattr(rule, "allow_inf_nan", None) is False:
                    bounds.append("finite")
    name = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    name = name or str(annotation).replace("typing.", "")
    return " ".join([name, ", ".join(bounds)]).strip()


def _default(parameter: inspect.Parameter) -> str:
    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
        return ""
    if parameter.default is inspect.Parameter.empty:
        return "required"
    return f"`{parameter.default!r}`"


def _score_input_fields() -> list[tuple[str, str, str]]:
    """(name, type, its docstring) of every field of ``ScoreInput``, read from its source."""
    tree = ast.parse(SCORES.read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ScoreInput")
    fields = []
    for statement, following in zip(cls.body, [*cls.body[1:], None]):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            doc = (following.value.value if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                   else "")
            fields.append((statement.target.id, ast.unparse(statement.annotation), inspect.cleandoc(doc)))
    return fields


def _patterns_paragraph() -> str:
    """The paragraph of the registry's module docstring on regex syntax (``Patterns (...) ...``)."""
    doc = ast.get_docstring(ast.parse(SCORES.read_text())) or ""
    for paragraph in doc.split("\n\n"):
        if paragraph.startswith("Patterns"):
            return " ".join(paragraph.split()).replace("\\\\", "\\")
    raise RuntimeError(f"{SCORES.relative_to(ROOT)}'s docstring has no paragraph on patterns (\"Patterns ...\")")


def _first_sentence(text: str) -> str:
    """The docstring's first sentence (up to its first period followed by a space), on one line."""
    first = " ".join(text.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".") + "."


def _markdown(text: str) -> str:
    """A docstring's reStructuredText literals (````x````) as markdown code spans."""
    return re.sub(r"``(.+?)``", r"`\1`", text)


def render() -> dict[str, str]:
    from rlfleet.services.reward import functions, scores

    aliases: dict[str, list[str]] = {}
    for alias, target in sorted(functions.ALIASES.items()):
        aliases.setdefault(target, []).append(alias)
    names = scores.available()
    lines = [*generated_banner("scripts/gen_docs/rewards.py", "the reward service's registry of reward functions "
                               "(services/reward/scores.py)"),
             "# Reward functions", "",
             "The reward service scores each sample with the reward function its prompt names. A prompt names it "
             "with `reward_fn` and gives its parameters with `reward_args` (in an SDK prompt dict: "
             "`{\"prompt\": ..., \"ground_truth\": \"5\", \"reward_fn\": \"numeric_match\", "
             "\"reward_args\": {\"tolerance\": \"0.01\"}}`); a prompt that names none gets the collector's setting "
             "`reward_fn` (`numeric_match` unless configured), and an empty one that the reward service's "
             "`default_reward_fn` with its `default_reward_params`. Parameters travel as strings: each is "
             "converted to its parameter's type and checked against its bounds before the function runs. "
             "`submit_prompts` refuses a prompt whose function the reward service does not have (NOT_FOUND) or "
             "whose parameters it does not take (INVALID_ARGUMENT), naming the prompt; a function that fails on "
             "a sample (no ground truth where it needs one, a user function that raises) dead-letters the prompt "
             "with the reason (`client.failures()`).", "",
             "The function's score, plus the episode's environment reward in a multi-turn episode, is the "
             "batch's `score`; clipped (`score_clip`) it is `clipped_score`, which the group advantage and the "
             "last token's reward are computed from ([batch schema](../batch-schema.md)).", "",
             "| function | computes | from a request |", "|---|---|---|"]
    for name in names:
        text, _ = _docstring_parts(name, scores._REGISTRY[name])
        request = "no: configure it on the reward service" if name in functions.CONFIG_ONLY else "yes"
        also = f" (also `{'`, `'.join(aliases[name])}`)" if name in aliases else ""
        lines.append(f"| [`{name}`](#{name}){also} | {cell(_markdown(_first_sentence(text)))} | {request} |")
    lines += ["", f"*{_markdown(_patterns_paragraph())}*", ""]
    for name in names:
        factory = scores._REGISTRY[name]
        text, described = _docstring_parts(name, factory)
        lines += [f"## {name}", ""]
        if name in aliases:
            lines += [f"Also accepted as {', '.join(f'`{alias}`' for alias in aliases[name])}.", ""]
        if name in functions.CONFIG_ONLY:
            lines += ["Only from the reward service's config (an entry of `reward_functions`, or "
                      "`default_reward_fn`): a request naming it is refused, so no remote caller makes the "
                      "service load a model.", ""]
        lines += [_markdown(text), ""]
        parameters = list(scores.factory_signature(name).parameters.values())
        missing = [p.name for p in parameters if p.name not in described]
        if missing:
            raise RuntimeError(f"reward function {name!r}: its docstring's Args: section does not describe "
                               f"{missing} ({SCORES.relative_to(ROOT)})")
        if parameters:
            lines += ["| parameter | type | default | meaning |", "|---|---|---|---|"]
            for parameter in parameters:
                shown = f"**{parameter.name}" if parameter.kind is inspect.Parameter.VAR_KEYWORD else parameter.name
                lines.append(f"| `{shown}` | {cell(_type(parameter.annotation))} | {_default(parameter)} | "
                             f"{cell(_markdown(described[parameter.name]))} |")
        else:
            lines.append("No parameters.")
        lines.append("")
    lines += ["## Your own function", "",
              "The reward service's config names a Python function by import path, `package.module:function`: "
              "in `default_reward_fn`, or in an entry of `reward_functions`, which requests then name by its key "
              "(`{\"mine\": {\"function\": \"mypkg.rewards:score\", \"params\": {...}}}`, then "
              "`\"reward_fn\": \"mine\"`; the way requests use a `reward_model` too). Import paths are accepted "
              "only from the config, never from a request, and a request naming a `reward_functions` entry gives no "
              "`reward_args` (its parameters are the entry's). The function is called once per sample as "
              "`function(sample, **params) -> float` (`params`: the entry's, or `default_reward_params`) and "
              "must return a finite number; "
              "what it raises dead-letters the prompt, quoted. `sample` is a `ScoreInput` "
              "(`services/reward/scores.py`):", "",
              "| field | type | meaning |", "|---|---|---|"]
    lines += [f"| `{field}` | `{kind}` | {cell(_markdown(doc))} |" for field, kind, doc in _score_input_fields()]
    return {"reference/rewards.md": "\n".join(lines).rstrip() + "\n"}
