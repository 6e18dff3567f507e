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
    the current state, a node's row the state after its own path); `g` is left as it was (paths consumed, then
    rolled back).

    1. a drafted node whose token the grammar refuses in the state reached along its path is pruned (with its
       subtree); an end token's node keeps no children (nothing follows it);
    2. then, while the tree holds fewer than `budget` nodes: where a state allows exactly one token (a marker, a
       closing quote, a key) and no child has it, the forced token is added as a child -- the target's choice there
       is certain, so the verify can go on past it. The root's forced run first, then the kept nodes' in order.
    Kept nodes keep their order (the accept walk takes the first matching child); added ones follow them."""
    parents = np.asarray(tree.parents, np.int64)
    tokens = np.asarray(tree.tokens, np.int64)
    depths = np.asarray(tree.depths, np.int64)
    children: List[List[int]] = [[] for _ in range(len(parents) + 1)]      # by row: 0 root, i + 1 node i
    for i, p in enumerate(parents):
        children[int(p) + 1].append(i)
    ends = frozenset(int(e) for e in ends) | frozenset(g.spec.grammars.ends)
    everything = np.full_like(g.bits(), 0xFFFFFFFF)
    root_mask, root_bits = g.mask(), g.bits()
    kept: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}     # drafted node -> (mask bool[V], bits) of its row

    def visit(row: int, allowed: np.ndarray) -> None:      # pass 1: g is at tree row `row`'s state
        for c in children[row]:
            t = int(tokens[c])
            if not (0 <= t < g.vocab_size and allowed[t]):
                continue
            if t in ends:                                 # the answer ends here: its row is never read masked
                kept[c] = (allowed, everything)
                continue
            g.push(t)
            try:
                kept[c] = (g.mask(), g.bits())
                visit(c + 1, kept[c][0])
            finally:
                g.pop(1)

    visit(0, root_mask)
    order = sorted(kept)
    nodes = [(int(tokens[c]), -1 if parents[c] < 0 else order.index(int(parents[c])), int(depths[c])) for c in order]
    bits = [kept[c][1] for c in order]
    room = max(int(budget), len(parents)) - len(nodes)
    if room > 0:                                          # pass 2: forced runs, the root's first
        room = _add_forced(g, nodes, bits, [kept[c][0] for c in order], root_mask, ends, room)
    if len(nodes) == len(parents) and order == list(range(len(parents))):
        return tree, np.stack([root_bits] + bits)
    par = np.array([p for _, p, _ in nodes], np.int32)
    out = Tree(np.array([t for t, _, _ in nodes], np.int32), par, np.array([d for _, _, d in nodes], np.int32),
               ancestor_visibility(par))
    return out, np.stack([root_bits] + bits)


def _add_forced(g: GrammarState, nodes: List[Tuple[int, int, int]], bits: List[np.ndarray],
                masks: List[np.ndarray], root_mask: np.ndarray, ends: frozenset, room: int) -> int:
    """Append forced runs to `nodes` (token, parent index, depth) and their rows' bits, at most `room` nodes; from the
    root, then from every node as it stood before (its state replayed along its path). Returns the room left."""
    n0 = len(nodes)
    for at in [-1] + list(range(n0)):
        if room <= 0:
            break
        path, k = [], at
        while k >= 0:
            path.insert(0, nodes[k][0])
            k = nodes[k][1]
        if path and path[-1] in ends:
            continue
        taken = {t for t, p, _ in nodes if p == at}
        allowed = root_mask if at < 0 else masks[at]
        for t in path:
            g.push(t)
        pushed, parent, depth = 0, at, len(path)
        try:
            while room > 0:
                only = np.flatnonzero(allowed)
                if len(only) != 1 or (pushed == 0 and int(only[0]) in taken):
                    break
                t = int(only[0])
                depth += 1
                nodes.append((t, parent, depth))
                parent, room = len(nodes) - 1, room - 1
                if t in ends:
                    bits.append(np.full_like(g.bits(), 0xFFFFFFFF))
                    break
                g.push(t)
                pushed += 1
                allowed = g.mask()
                bits.append(g.bits())
        finally:
            g.pop(len(path) + pushed)
    return room


def choose_rows(ops, logits: np.ndarray, bitmask: np.ndarray, greedy: bool) -> np.ndarray:
    """Under a grammar: greedy -> i32[T] each row's masked argmax; else f32[T, V] a masked copy to sample from
    (the logits themselves stay as they are: logprobs report the model's own distribution)."""
    if greedy:
        return ops.masked_argmax(logits, bitmask)
    return ops.token_bitmask_apply(np.array(logits, np.float32, order="C"), bitmask)


__all__ = ["GrammarError", "GrammarSpec", "GrammarState", "Grammars", "choose_rows", "constrain_tree"]
