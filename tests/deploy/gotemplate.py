"""Renders a Helm chart in Python: the subset of Go templates and Sprig functions our chart uses.

No helm binary can be installed from the registries this project reaches (PyPI, Debian, npm), and
the helm library in the helm-sdkpy wheel has no `template`, so the chart's tests render it here
(test_chart.py checks that helm, through its lint, renders the same objects). What the chart
uses: actions with `{{-`/`-}}` trimming, comments, pipelines, `if`/`else if`/`else`, `range`
(with `$key, $value :=`), `with`, `define`/`include`, and the functions in FUNCTIONS. Anything
else raises TemplateError, so the chart cannot drift into syntax this renderer would render
wrongly without a test failing.

As a command it prints a chart's manifests as `helm template` does, where no helm is installed:

  python -m tests.deploy.gotemplate deploy/helm/tritonllm --set engine.max_batch_size=128
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

import yaml


class TemplateError(Exception):
    pass


# ---- lexing -------------------------------------------------------------------------------------
_ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<num>-?\d+(?:\.\d+)?)|(?P<open>\()|(?P<close>\))'
    r"|(?P<pipe>\|)|(?P<assign>:=)|(?P<comma>,)|(?P<word>[$.]?[A-Za-z_$][\w.$]*|\.))"
)


def _lex(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(text):
        if not text[pos:].strip():
            break
        match = _TOKEN.match(text, pos)
        if not match or match.end() == pos:
            raise TemplateError(f"cannot read {text[pos:]!r}")
        kind = match.lastgroup
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


# ---- parsing ------------------------------------------------------------------------------------
@dataclass
class Node:
    kind: str  # text | action | if | range | with | define
    text: str = ""
    tokens: list = field(default_factory=list)
    body: list = field(default_factory=list)
    orelse: list = field(default_factory=list)
    names: tuple = ()


def parse(source: str) -> list[Node]:
    """The template as a tree of nodes (defines are collected by Chart)."""
    pieces: list = []
    pos = 0
    for match in _ACTION.finditer(source):
        text = source[pos : match.start()]
        if match.group(1):
            text = text.rstrip(" \t\r\n")
        if pieces and pieces[-1] == "TRIM":
            pieces.pop()
            text = text.lstrip(" \t\r\n")
        pieces.append(Node("text", text=text))
        pieces.append(match.group(2).strip())
        if match.group(3):
            pieces.append("TRIM")
        pos = match.end()
    tail = source[pos:]
    if pieces and pieces[-1] == "TRIM":
        pieces.pop()
        tail = tail.lstrip(" \t\r\n")
    pieces.append(Node("text", text=tail))
    nodes, rest = _parse_block(iter(pieces), top=True)
    return nodes


def _parse_block(pieces, top: bool = False):
    """Nodes up to the matching `end` or `else`; returns (nodes, the closing keyword)."""
    nodes: list[Node] = []
    for piece in pieces:
        if isinstance(piece, Node):
            nodes.append(piece)
            continue
        if piece.startswith("/*"):
            continue
        word = piece.split(None, 1)[0] if piece else ""
        rest = piece[len(word) :].strip()
        if word in ("end", "else"):
            if top:
                raise TemplateError(f"unexpected {{{{ {piece} }}}}")
            return nodes, piece
        if word in ("if", "with", "range"):
            node = Node(word)
            if word == "range" and ":=" in rest:
                names, rest = rest.split(":=", 1)
                node.names = tuple(n.strip() for n in names.split(","))
            node.tokens = _lex(rest)
            node.body, closing = _parse_block(pieces)
            branch = node
            while closing != "end":
                if closing.startswith("else if"):
                    inner = Node("if", tokens=_lex(closing[len("else if") :]))
                    inner.body, closing = _parse_block(pieces)
                    branch.orelse = [inner]
                    branch = inner
                elif closing == "else":
                    branch.orelse, closing = _parse_block(pieces)
                    if closing != "end":
                        raise TemplateError(f"{{{{ {closing} }}}} after else")
                else:
                    raise TemplateError(f"unsupported {{{{ {closing} }}}}")
            nodes.append(node)
        elif word == "define":
            node = Node("define", names=(json.loads(rest),))
            node.body, closing = _parse_block(pieces)
            if closing != "end":
                raise TemplateError("define without end")
            nodes.append(node)
        else:
            nodes.append(Node("action", tokens=_lex(piece)))
    if not top:
        raise TemplateError("missing {{ end }}")
    return nodes, None


# ---- evaluation ---------------------------------------------------------------------------------
def _truthy(value) -> bool:
    return value not in (None, False, 0, "") and not (isinstance(value, (dict, list)) and not value)


def _to_text(value) -> str:
    if value is None:
        return "<no value>"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _go_float(float(value))
    if isinstance(value, (dict, list)):
        raise TemplateError(f"printing a {type(value).__name__} needs toYaml: {value!r}")
    return str(value)


def _go_float(value: float) -> str:
    """Go's %v of a float64, as helm prints every number it read from YAML: the shortest digits,
    in exponent form from 1e+06 up and below 1e-04 (so 1000000 prints as 1e+06)."""
    if value == 0:
        return "0"
    sign, digits, exponent = Decimal(repr(value)).normalize().as_tuple()
    text, point = "".join(map(str, digits)), len(digits) + exponent
    minus = "-" if sign else ""
    if point - 1 < -4 or point - 1 >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        return f"{minus}{mantissa}e{point - 1:+03d}"
    if point <= 0:
        return f"{minus}0.{'0' * -point}{text}"
    if point >= len(text):
        return minus + text + "0" * (point - len(text))
    return f"{minus}{text[:point]}.{text[point:]}"


def _to_yaml(value) -> str:
    if value in ({}, []):
        return "{}" if value == {} else "[]"
    return yaml.safe_dump(value, default_flow_style=False, sort_keys=True).rstrip("\n")


def _indent(n, text) -> str:
    return "\n".join(" " * int(n) + line for line in str(text).split("\n"))


FUNCTIONS = {
    "quote": lambda *v: " ".join(json.dumps(_to_text(x)) for x in v),
    "toYaml": _to_yaml,
    "toJson": lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True),
    "indent": _indent,
    "nindent": lambda n, text: "\n" + _indent(n, text),
    "default": lambda fallback, value=None: value if _truthy(value) else fallback,
    "replace": lambda old, new, text: str(text).replace(old, new),
    "printf": lambda fmt, *args: re.sub(r"%[sdv]", "{}", fmt).format(*map(_to_text, args)),
    "trunc": lambda n, text: str(text)[: int(n)],
    "trimSuffix": lambda suffix, text: text[: -len(suffix)] if text.endswith(suffix) else text,
    "toString": _to_text,
    "eq": lambda a, *b: any(a == x for x in b),
    "ne": lambda a, b: a != b,
    "not": lambda v: not _truthy(v),
    "and": lambda *v: next((x for x in v if not _truthy(x)), v[-1]),
    "or": lambda *v: next((x for x in v if _truthy(x)), v[-1]),
    "list": lambda *v: list(v),
    "index": lambda obj, *keys: _index(obj, keys),
    "kindIs": lambda kind, value: _kind(value) == kind,
    "fail": lambda message: _fail(message),
}


def _kind(value) -> str:
    """Go's reflect kind of a value as helm holds it (every number read from YAML is a float64)."""
    if value is None:
        return "invalid"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "float64"
    return {str: "string", dict: "map", list: "slice"}[type(value)]


def _index(obj, keys):
    for key in keys:
        obj = obj.get(key) if isinstance(obj, dict) else obj[key]
    return obj


def _fail(message: str):
    raise TemplateError(f"fail: {message}")


@dataclass
class Scope:
    dot: object
    root: dict
    variables: dict


class Chart:
    """A chart directory: Chart.yaml, values.yaml and templates/."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.meta = yaml.safe_load((self.path / "Chart.yaml").read_text())
        self.defaults = yaml.safe_load((self.path / "values.yaml").read_text()) or {}
        self.templates = {
            p.name: parse(p.read_text()) for p in sorted((self.path / "templates").iterdir())
        }
        self.defines: dict[str, list[Node]] = {}
        for nodes in self.templates.values():
            for node in nodes:
                if node.kind == "define":
                    self.defines[node.names[0]] = node.body

    def render_values(self, values: dict | None = None) -> dict:
        """values.yaml with `values` merged over it, as `helm install -f` merges them."""
        return _merge(self.defaults, values or {})

    def render(
        self, values: dict | None = None, release: str = "test", namespace: str = "default"
    ) -> dict[str, str]:
        """{template name: rendered text} for every template not starting with `_`."""
        merged = self.render_values(values)
        root = {
            "Values": merged,
            "Release": {"Name": release, "Namespace": namespace, "Service": "Helm"},
            "Chart": {
                "Name": self.meta["name"],
                "Version": self.meta["version"],
                "AppVersion": self.meta.get("appVersion", ""),
            },
        }
        return {
            name: self._run(nodes, Scope(root, root, {"$": root}))
            for name, nodes in self.templates.items()
            if not name.startswith("_")
        }

    def manifests(self, values: dict | None = None, **kwargs) -> list[dict]:
        """Every rendered Kubernetes object, parsed."""
        docs = []
        for name, text in self.render(values, **kwargs).items():
            try:
                docs += [d for d in yaml.safe_load_all(text) if d]
            except yaml.YAMLError as exc:
                raise TemplateError(f"{name} renders invalid YAML: {exc}\n{text}") from None
        return docs

    def _run(self, nodes: list[Node], scope: Scope) -> str:
        out = []
        for node in nodes:
            if node.kind == "text":
                out.append(node.text)
            elif node.kind == "action":
                out.append(_to_text(self._pipeline(node.tokens, scope)))
            elif node.kind == "if":
                branch = node.body if _truthy(self._pipeline(node.tokens, scope)) else node.orelse
                out.append(self._run(branch, scope))
            elif node.kind == "with":
                value = self._pipeline(node.tokens, scope)
                if _truthy(value):
                    out.append(self._run(node.body, Scope(value, scope.root, scope.variables)))
                else:
                    out.append(self._run(node.orelse, scope))
            elif node.kind == "range":
                out.append(self._range(node, scope))
        return "".join(out)

    def _range(self, node: Node, scope: Scope) -> str:
        items = self._pipeline(node.tokens, scope)
        if isinstance(items, dict):
            pairs = sorted(items.items())  # Go ranges over a map in key order
        else:
            pairs = list(enumerate(items or []))
        out = []
        for key, value in pairs:
            variables = dict(scope.variables)
            if len(node.names) == 2:
                variables[node.names[0]], variables[node.names[1]] = key, value
            elif len(node.names) == 1:
                variables[node.names[0]] = value
            out.append(self._run(node.body, Scope(value, scope.root, variables)))
        return "".join(out) if pairs else self._run(node.orelse, scope)

    def _pipeline(self, tokens: list, scope: Scope):
        commands, current, depth = [], [], 0
        for token in tokens:
            depth += token[0] == "open"
            depth -= token[0] == "close"
            if token[0] == "pipe" and depth == 0:
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
        value, piped = None, False
        for command in commands:
            args = self._args(command, scope)
            extra = [value] if piped else []
            value = self._call(args, extra)
            piped = True
        return value

    def _args(self, tokens: list, scope: Scope) -> list:
        args, i = [], 0
        while i < len(tokens):
            kind, text = tokens[i]
            if kind == "open":
                depth, j = 1, i + 1
                while depth:
                    depth += tokens[j][0] == "open"
                    depth -= tokens[j][0] == "close"
                    j += 1
                args.append(("value", self._pipeline(tokens[i + 1 : j - 1], scope)))
                i = j
                continue
            if kind == "str":
                args.append(("value", json.loads(text)))
            elif kind == "num":
                args.append(("value", float(text) if "." in text else int(text)))
            elif kind == "word" and text in FUNCTIONS or text == "include":
                args.append(("function", text))
            elif kind == "word" and text in ("true", "false"):
                args.append(("value", text == "true"))
            elif kind == "word":
                args.append(("value", self._lookup(text, scope)))
            else:
                raise TemplateError(f"unexpected {text!r}")
            i += 1
        return args

    def _call(self, args: list, piped: list):
        if not args:
            raise TemplateError("empty command")
        kind, head = args[0]
        values = [v for _, v in args[1:]] + piped
        if kind == "value":
            if values:
                raise TemplateError(f"{head!r} is not a function")
            return head
        if head == "include":
            name, dot = values
            if name not in self.defines:
                raise TemplateError(f"no template {name!r}")
            return self._run(self.defines[name], Scope(dot, dot, {"$": dot}))
        return FUNCTIONS[head](*values)

    def _lookup(self, text: str, scope: Scope):
        if text == ".":
            return scope.dot
        if text.startswith("$"):
            name, _, path = text.partition(".")
            if name not in scope.variables:
                raise TemplateError(f"undefined variable {name}")
            value = scope.variables[name]
        elif text.startswith("."):
            value, path = scope.dot, text[1:]
        else:
            raise TemplateError(f"unknown function {text!r}")
        for part in filter(None, path.split(".")):
            if not isinstance(value, dict):
                raise TemplateError(f"{text}: {part!r} of a {type(value).__name__}")
            value = value.get(part)
        return value


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# ---- command line -------------------------------------------------------------------------------
def set_value(values: dict, assignment: str) -> None:
    """`a.b=c` into values, as `helm --set` reads it (the value a YAML scalar)."""
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise SystemExit(f"--set takes KEY=VALUE, got {assignment!r}")
    *parents, last = path.split(".")
    node = values
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = yaml.safe_load(text) if text else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.deploy.gotemplate",
        description="Print a chart's manifests as `helm template` does, rendered by this module.",
    )
    parser.add_argument("chart", type=Path, help="the chart's directory")
    parser.add_argument("-f", "--values", type=Path, action="append", default=[])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--release", default="release-name", help="the release's name")
    parser.add_argument("--namespace", default="default")
    args = parser.parse_args(argv)
    values: dict = {}
    for path in args.values:
        values = _merge(values, yaml.safe_load(path.read_text()) or {})
    for assignment in args.set:
        set_value(values, assignment)
    try:
        rendered = Chart(args.chart).render(values, release=args.release, namespace=args.namespace)
    except TemplateError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    for name, text in rendered.items():
        if text.strip():
            print(f"---\n# Source: {args.chart.name}/templates/{name}\n{text.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
