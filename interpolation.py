"""verl's `${...}` interpolations (OmegaConf's), resolved in a merged config tree the way verl resolves them, so a
verl yaml saved unresolved (e.g. verl v0.5.0's `verl/trainer/config/_generated_ppo_trainer.yaml`) loads with the
values verl would compute. They are resolved after the yaml and every override are merged, as OmegaConf resolves
lazily: an override of `actor_rollout_ref.actor.ppo_mini_batch_size` reaches `critic.ppo_mini_batch_size` when that
holds `${oc.select:actor_rollout_ref.actor.ppo_mini_batch_size,256}`.

The forms verl's configs use:
  ${a.b.c}                  the value at a.b.c (from the root; a leading `backend_config.` is dropped)
  ${.key}, ${..key}         relative: a key of the mapping holding the value, or of its parent, ...
  ${oc.select:a.b,default}  the value at a.b, or `default` when a.b is not a key (or is `???`); a null value
                            stays null, as in OmegaConf. The default is a yaml scalar or list; quote a string
                            that holds a comma.
  text ${a} text            a value holding text around interpolations is a string (each value as str()).
Left out: other resolvers (`oc.env`, `oc.eval`, ...), interpolations nested inside one another, `a[0]` indexing,
escaping (`\\${`); each is an error naming the key and the expression.
"""
from __future__ import annotations

import re

import yaml

from config_keys import MAX_DEPTH, MAX_VALUES, ConfigError

MAX_RESOLVED_CHARS = 1 << 20     # a string built from interpolations is at most this long
_WHOLE = re.compile(r"\$\{([^{}]*)\}")
_MISSING = object()


def resolve_interpolations(tree, source="the config"):
    """Replace every `${...}` in the nested dicts/lists of `tree` (in place) by the value it names."""
    resolver = _Resolver(tree, source)
    resolver.visit(tree, [])
    return tree


def _show_path(path):
    return ".".join(str(part) for part in path)


class _Resolver:
    def __init__(self, tree, source):
        self.tree, self.source, self.budget = tree, source, MAX_VALUES

    def visit(self, node, path):
        for key, value in list(node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(value, (dict, list)):
                self.visit(value, path + [key])
            elif isinstance(value, str) and "${" in value:
                node[key] = self.resolve(value, path + [key], [])

    def error(self, path, text, why):
        return ConfigError(f"config key '{_show_path(path)}' = {text!r} ({self.source}): {why}")

    def resolve(self, text, path, chain):
        """The value of the string `text` held at `path`; `chain` is the keys being resolved (a cycle guard)."""
        if path in chain:
            cycle = " -> ".join(_show_path(p) for p in chain[chain.index(path):] + [path])
            raise self.error(chain[0], self._at(chain[0]), f"the interpolations refer to each other: {cycle}")
        if len(chain) > MAX_DEPTH:
            raise self.error(chain[0], self._at(chain[0]), f"more than {MAX_DEPTH} interpolations lead from one "
                                                           f"to the next")
        chain = chain + [path]
        if "\\${" in text:
            raise self.error(path, text, "escaped interpolations (\\${) are not resolved; write the text another way")
        if "${" in _WHOLE.sub("", text):
            raise self.error(path, text, "interpolations nested in one another (or left unclosed) are not resolved; "
                                         "write the value instead")
        whole = _WHOLE.fullmatch(text)
        if whole:                                    # the whole value: keeps the referenced value's type
            return self.expression(whole[1], text, path, chain)
        pieces, end = [], 0
        for match in _WHOLE.finditer(text):
            pieces += [text[end:match.start()], str(self.expression(match[1], text, path, chain))]
            end = match.end()
            if sum(map(len, pieces)) > MAX_RESOLVED_CHARS:
                raise self.error(path, text, f"resolves to more than {MAX_RESOLVED_CHARS} characters")
        return "".join(pieces) + text[end:]

    def expression(self, inner, text, path, chain):
        inner = inner.strip()
        if inner.startswith("oc.select:"):
            key, comma, default = inner[len("oc.select:"):].partition(",")
            value = self.lookup(key.strip(), text, path, chain)
            if value is _MISSING or value == "???":
                return self.default(default, text, path) if comma else None
            return value
        if ":" in inner:
            raise self.error(path, text, f"the resolver '{inner.split(':')[0]}' is not one minirl resolves (it "
                                         f"resolves ${{key}} and ${{oc.select:key,default}}); write the value instead")
        value = self.lookup(inner, text, path, chain)
        if value is _MISSING:
            raise self.error(path, text, f"'{inner}' is not a key of the config")
        return value

    def default(self, text, where_text, path):
        text = text.strip()
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
            return text[1:-1]
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = None
        if isinstance(value, dict) or (value is None and text.lower() not in ("null", "~")):
            raise self.error(path, where_text, f"the default {text!r} of oc.select is not a yaml scalar or list")
        return value

    def lookup(self, key, text, path, chain):
        """The resolved value at `key` (absolute, or relative to `path` with leading dots), or _MISSING."""
        dots = len(key) - len(key.lstrip("."))
        parts = key[dots:].split(".")
        if not all(re.fullmatch(r"[A-Za-z0-9_\-]+", part) for part in parts):
            raise self.error(path, text, f"'{key}' is not a key like a.b.c (from the top) or .c (beside this one)")
        if dots > len(path):
            raise self.error(path, text, f"'{key}' goes up past the top of the config")
        if not dots and parts[0] == "backend_config":        # the seed's shape: verl's sections sit under it
            parts = parts[1:]
        base = path[:len(path) - dots] if dots else []   # '.c': beside this key; each further dot: one level up
        target = base + parts
        node = self.tree
        for part in target:
            if not isinstance(node, dict) or part not in node:
                return _MISSING
            node = node[part]
        return self.copy(node, target, chain)

    def copy(self, node, path, chain):
        """`node` with its own interpolations resolved (each value counted against the budget)."""
        self.budget -= 1
        if self.budget < 0:
            raise ConfigError(f"{self.source}: more than {MAX_VALUES} values once its interpolations are resolved")
        if isinstance(node, dict):
            return {key: self.copy(value, path + [key], chain) for key, value in node.items()}
        if isinstance(node, list):
            return [self.copy(value, path + [i], chain) for i, value in enumerate(node)]
        if isinstance(node, str) and "${" in node:
            return self.resolve(node, path, chain)
        return node

    def _at(self, path):
        node = self.tree
        for part in path:
            node = node[part]
        return node
