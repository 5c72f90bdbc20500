"""Grammar-constrained decoding: a request's `Constraint` as token masks.

`compiler.py` turns a constraint (JSON schema, json_object, regex, EBNF/GBNF, Lark) into an
llguidance grammar, validates it against the tokenizer (the front end's 400s) and caches
compiled matchers; `matcher.py` is one request's matcher: the mask at its committed state,
the masks of every node of a draft tree along the node's own path, and the commit that
advances it. `queue.py` builds matchers off the scheduler's thread.

Why llguidance: the mask for a 150k vocabulary costs tens of microseconds (a token trie
walked by a lexer-driven Earley parser, no per-grammar precomputation over the vocabulary,
so a new schema is ready in about a millisecond); rollback of any number of tokens is
built in, which is what a draft tree needs (consume a node's token, take its mask, roll
back); it ships an abi3 CPU wheel with no dependency; and it reads JSON schemas, regexes,
Lark and GBNF. xgrammar masks as fast once compiled, but compiles each grammar against the
vocabulary first (tens to hundreds of milliseconds for a new schema) and its wheel pulls
in torch and transformers.
"""
