"""The ingress core: what every front end (the platform bots, the terminal chat, the bridge and the
coding-agent hooks) does with what a person types, reacts or presses.

- `grammar`: the one ``/rl`` grammar and the thumbs reactions, as plain values.
- `replies`: the words a front end answers with when it has no wording of its own.
- `usecases`: answer and capture, rate, undo, command; each input becomes at most one event, after one
  permission decision (`rlfleet.shared.permissions`).

Front ends only translate their platform's input and output into these calls. `grammar` and `replies`
use the standard library only (the hooks import them and must start in milliseconds), so this package
imports nothing here.
"""
