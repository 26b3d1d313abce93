"""Grammar-constrained decoding: a sequence whose sampling params carry a ``StructuredSpec``
(``common/structured.py``) samples only tokens its grammar allows.

- ``compiler.GrammarCompiler`` turns a spec into a grammar, off the step thread and cached by the
  spec's text: xgrammar first, llguidance where xgrammar cannot compile it (or not in time).
- ``state.GrammarState`` is one sequence's place in its grammar: built once the grammar is
  compiled, advanced over the output so far (on a decode worker: the prefill worker's first
  token, or everything before a migration) and over each token the scheduler appends; its
  output is complete when the grammar is.
- ``masks.fill_masks`` fills, for a step's sampling rows, the bitmask of the tokens each may
  take (a speculative row's after the proposals before it, taken tentatively and rolled back);
  the sampler applies it before anything else.
"""
