"""Grammar-constrained decoding with llguidance: token masks from the model's vocabulary, one matcher per request.

    grammars = Grammars.for_tokenizer(tokenizer, vocab_size)        # once per engine (cached per tokenizer)
    spec = grammars.json_schema(schema, param="response_format")    # GrammarError (a 400) when it cannot compile
    spec = grammars.lark(text, param="tool_choice")                 # Lark from kdtree/serve/tools.py, where
    rule = grammars.json_rule(parameters, param="tools[0].function.parameters")   # `args: %json {...}` (compact)
    req = Request(prompt, n, grammar=spec.start())                  # a fresh matcher per request / per sample

The decode round (kdtree/decode/state.py) asks the request's `GrammarState` for the mask of the state reached by
the committed tokens (AR row, first token, a tree's root) and, for a tree, walks it depth first (consume a node's
token, take the mask, recurse, roll back) so every verify row's logits are masked by the state reached along that
row's own path; nodes whose token the grammar refuses are pruned before the verify. Every committed token is then
the target's masked choice given the committed prefix -- the same as AR with the grammar, for every tree.

Why llguidance (not xgrammar): a ~5 MB Rust wheel with no dependency (xgrammar pulls torch, triton and
transformers); vLLM and SGLang ship it as a backend; JSON schema, Lark with embedded %json, regex, special
tokens by name; a mask over the tiny 260-token vocabulary costs ~4 us (measured: /tmp-free figure in the README).

JSON is compiled compact by default (`whitespace_flexible: false`): a model may not pad the output with unbounded
whitespace; a schema's own "x-guidance" options override it.
"""
from __future__ import annotations

import json
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kdtree.errors import ConfigError, KdtreeError
from kdtree.tree import Tree, ancestor_visibility

JSON_DEFAULTS = {"whitespace_flexible": False}


class GrammarError(ConfigError):
    """A grammar or schema the engine cannot compile (an HTTP 400 naming `param`)."""
    code = "invalid_grammar"

    def __init__(self, message: str, param: str = ""):
        super().__init__(message)
        self.param = param


def _end_ids(tokenizer) -> List[int]:
    """Tokens that end a constrained answer: eos, and the end-of-turn token when the vocabulary has one."""
    ends = [int(tokenizer.eos_id)] if getattr(tokenizer, "eos_id", None) is not None else []
    special = getattr(tokenizer, "special_tokens", {}) or {}
    for name in ("<|im_end|>",):
        if name in special and int(special[name]) not in ends:
            ends.append(int(special[name]))
    return ends


class _ByteVocab:
    """The byte tokenizer as llguidance's TokenizerWrapper wants it: bytes per id, the special ids."""

    def __init__(self, tok):
        n = int(tok.vocab_size)
        self.tokens = [bytes([i]) if i < 256 else f"<|special_{i}|>".encode() for i in range(n)]
        self.special_token_ids = sorted(int(i) for i in tok.special_ids)
        self.eos_token_id = int(tok.eos_id)
        self.bos_token_id = int(tok.bos_id)

    def __call__(self, s):
        return list(s) if isinstance(s, bytes) else list(s.encode("utf-8"))


def _lltokenizer(tokenizer, vocab_size: int):
    import llguidance
    from llguidance import LLTokenizer, TokenizerWrapper

    ends = _end_ids(tokenizer)
    if hasattr(tokenizer, "enc"):                          # Kimi's tiktoken (k26)
        from llguidance.tiktoken import lltokenizer_from_encoding
        return lltokenizer_from_encoding(tokenizer.enc, n_vocab=int(vocab_size), eos_token=ends)
    if type(tokenizer).__name__ == "ByteTokenizer":
        return LLTokenizer(TokenizerWrapper(_ByteVocab(tokenizer)), n_vocab=int(vocab_size), eos_token=ends)
    raise ConfigError(f"structured output needs a byte or tiktoken tokenizer; {type(tokenizer).__name__} is "
                      f"neither (llguidance {getattr(llguidance, '__version__', '?')})")


class GrammarState:
    """One request's matcher: the mask of the state reached by the tokens consumed so far."""

    def __init__(self, matcher, vocab_size: int, spec: "GrammarSpec"):
        self._m, self.vocab_size, self.spec = matcher, int(vocab_size), spec
        self._mask: Optional[np.ndarray] = None
        self._bits: Optional[np.ndarray] = None
        self.masks_computed = 0

    def mask(self) -> np.ndarray:
        """bool[V] (read-only): the tokens the grammar allows next (cached until the state changes)."""
        if self._mask is None:
            bits = np.frombuffer(self._m.compute_bitmask(), "<u4").astype(np.uint32)
            mask = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)
            if not mask.any():
                raise KdtreeError(f"the {self.spec.kind} allows no token here ({self._m.get_error() or 'dead end'})"
                                  f"; simplify the schema or grammar")
            mask.setflags(write=False)
            bits.setflags(write=False)
            self._mask, self._bits = mask, bits
            self.masks_computed += 1
        return self._mask

    def bits(self) -> np.ndarray:
        """u32[ceil(V/32)] (read-only): mask() packed as the native ops take it (bit v % 32 of word v // 32)."""
        self.mask()
        return self._bits

    def allows(self, token: int) -> bool:
        return 0 <= int(token) < self.vocab_size and bool(self.mask()[int(token)])

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over committed tokens; a token the grammar refuses is a bug of the caller (never masked)."""
        for t in tokens:
            if not self._m.consume_token(int(t)):
                raise RuntimeError(f"grammar refused committed token {int(t)}: {self._m.get_error()}")
        if tokens:
            self._mask = None

    def push(self, token: int) -> None:
        """Consume one token on a speculative path (undone by pop)."""
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"grammar refused token {int(token)} on a tree path: {self._m.get_error()}")
        self._mask = None

    def pop(self, n: int = 1) -> None:
        self._m.rollback(int(n))
        self._mask = None

    @property
    def stopped(self) -> bool:
        """The grammar is complete: only an end token may follow."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())


class GrammarSpec:
    """A compiled, validated grammar; `start()` gives each request (each of n samples) its own matcher."""

    def __init__(self, grammars: "Grammars", text: str, kind: str):
        self.grammars, self.text, self.kind = grammars, text, kind

    def start(self) -> GrammarState:
        from llguidance import LLMatcher

        m = LLMatcher(self.grammars.lltok, self.text, log_level=0)
        if m.is_error():
            raise GrammarError(f"grammar does not compile: {m.get_error()}")
        return GrammarState(m, self.grammars.vocab_size, self)


class Grammars:
    """The grammar compiler of one tokenizer (its llguidance vocabulary is built once: ~1 s for tiktoken)."""

    _cache: Dict[int, "Grammars"] = {}
    _lock = threading.Lock()

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, int(vocab_size)
        self.lltok = _lltokenizer(tokenizer, vocab_size)
        self.ends = tuple(_end_ids(tokenizer))            # the tokens that end a constrained answer
        self.special = dict(getattr(tokenizer, "special_tokens", {}) or {})

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int) -> "Grammars":
        with cls._lock:
            key = id(tokenizer)
            g = cls._cache.get(key)
            if g is None or g.tokenizer is not tokenizer or g.vocab_size != int(vocab_size):
                g = cls._cache[key] = cls(tokenizer, vocab_size)
            return g

    def marker(self, text: str) -> str:
        """A literal in a Lark grammar: the special token itself when the vocabulary has it as one (k26's
        `<|tool_call_begin|>`), else the text (tiny's byte tokenizer spells markers in bytes)."""
        if text in self.special:
            return text                                   # llguidance: <|name|> matches the special token
        return json.dumps(text)

    def _checked(self, text: str, kind: str, param: str) -> GrammarSpec:
        from llguidance import LLMatcher

        err = LLMatcher.validate_grammar(text, self.lltok)
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"{param}: cannot compile the {kind}: {err}", param=param)
        return GrammarSpec(self, text, kind)

    def json_schema(self, schema: Any, param: str = "response_format") -> GrammarSpec:
        """A JSON schema (dict) -> a grammar of JSON values it accepts."""
        from llguidance import LLMatcher

        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}",
                               param=param)
        _check_schema(schema, param)
        try:
            text = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{param}: not a JSON schema: {e}", param=param) from None
        return self._checked(text, "JSON schema", param)

    def json_rule(self, schema: Any, param: str = "schema") -> str:
        """`%json {...}`: a Lark rule body accepting the JSON values of `schema`, checked, compact by default (the
        options of json_schema(); a schema's own "x-guidance" wins)."""
        if not isinstance(schema, dict):
            raise GrammarError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}",
                               param=param)
        _check_schema(schema, param)
        own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
        return "%json " + json.dumps({**schema, "x-guidance": {**JSON_DEFAULTS, **own}})

    def lark(self, text: str, param: str = "grammar") -> GrammarSpec:
        from llguidance import LLMatcher

        return self._checked(LLMatcher.grammar_from_lark(text), "grammar", param)


def _check_schema(schema: Dict[str, Any], param: str) -> None:
    """A schema that is not valid JSON Schema (draft 2020-12 metaschema) is a 400 before llguidance sees it."""
    try:
        import jsonschema
    except ImportError:                                   # llguidance still refuses unknown types
        return
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise GrammarError(f"{param}: invalid JSON schema{' at ' + where if where else ''}: {e.message}",
                           param=param) from None


def constrain_tree(g: GrammarState, tree: Tree, ends: Sequence[int] = (), budget: int = 0) -> Tuple[Tree, np.ndarray]:
    """The tree under the grammar, and u32[N'+1, ceil(V/32)] token bitmasks of its verify rows [root, nodes] (row 0
    the current state, a node's row the state after its own path); `g` is left as it was (each path consumed, then
    rolled back).

    - a node whose token the grammar refuses in the state reached along its path is pruned (with its subtree);
    - where a state allows exactly one token (a marker, a closing quote, a key) and no child has it, the forced
      token is added as a child while the tree holds fewer than `budget` nodes: the target's choice there is
      certain, so the verify can go on past it (the root's forced run first);
    - an end token's node keeps no children (nothing follows it).
    Kept nodes keep their order (the accept walk takes the first matching child); added ones follow them."""
    parents = np.asarray(tree.parents, np.int64)
    tokens = np.asarray(tree.tokens, np.int64)
    depths = np.asarray(tree.depths, np.int64)
    children: List[List[int]] = [[] for _ in range(len(parents) + 1)]      # by row: 0 root, i + 1 node i
    for i, p in enumerate(parents):
        children[int(p) + 1].append(i)
    ends = frozenset(int(e) for e in ends) | frozenset(g.spec.grammars.ends)
    everything = np.full_like(g.bits(), 0xFFFFFFFF)
    nodes: List[Tuple[int, int, int, int]] = []    # (order key, token, parent's index in nodes or -1, depth)
    masks: List[np.ndarray] = []                   # each node's allowed tokens: bool[V]
    bits: List[np.ndarray] = []                    # the same packed
    room = max(int(budget), len(parents))

    def add(key: int, token: int, parent: int, depth: int) -> Optional[int]:
        """Keep a node whose token the parent's state allows; its mask; its index (None: refused / no room)."""
        allowed = masks[parent] if parent >= 0 else root
        if not (0 <= token < g.vocab_size and allowed[token]) or len(nodes) >= room:
            return None
        nodes.append((key, token, parent, depth))
        if token in ends:                                 # the answer ends here: its row is never read masked
            masks.append(allowed)
            bits.append(everything)
            return None
        g.push(token)
        masks.append(g.mask())
        bits.append(g.bits())
        return len(nodes) - 1

    def visit(row: int, at: int, depth: int) -> None:
        """Children of tree row `row` (0 = root), kept as node `at` (-1 = root); g is at that node's state."""
        allowed = masks[at] if at >= 0 else root
        drafted = {int(tokens[c]) for c in children[row]} if row >= 0 else set()
        only = np.flatnonzero(allowed)
        if len(only) == 1 and int(only[0]) not in drafted:             # forced, and not drafted: add it
            k = add(len(parents) + len(nodes), int(only[0]), at, depth + 1)
            if k is not None:
                visit(-1, k, depth + 1)
                g.pop(1)
        for c in children[row] if row >= 0 else ():
            k = add(c, int(tokens[c]), at, int(depths[c]))
            if k is not None:
                visit(c + 1, k, int(depths[c]))
                g.pop(1)

    root = g.mask()
    visit(0, -1, 0)
    order = sorted(range(len(nodes)), key=lambda k: nodes[k][0])   # drafted nodes in their order, then added
    if len(order) == len(parents) and all(nodes[k][0] == i for i, k in enumerate(order)):
        return tree, np.stack([g.bits()] + bits)
    new = {k: i for i, k in enumerate(order)}
    par = np.array([-1 if nodes[k][2] < 0 else new[nodes[k][2]] for k in order], np.int32)
    kept = Tree(np.array([nodes[k][1] for k in order], np.int32), par,
                np.array([nodes[k][3] for k in order], np.int32), ancestor_visibility(par))
    return kept, np.stack([g.bits()] + [bits[k] for k in order])


def choose_rows(ops, logits: np.ndarray, bitmask: np.ndarray, greedy: bool) -> np.ndarray:
    """Under a grammar: greedy -> i32[T] each row's masked argmax; else f32[T, V] a masked copy to sample from
    (the logits themselves stay as they are: logprobs report the model's own distribution)."""
    if greedy:
        return ops.masked_argmax(logits, bitmask)
    return ops.token_bitmask_apply(np.array(logits, np.float32, order="C"), bitmask)


__all__ = ["GrammarError", "GrammarSpec", "GrammarState", "Grammars", "choose_rows", "constrain_tree"]
