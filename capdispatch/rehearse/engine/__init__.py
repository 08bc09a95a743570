"""The engine rehearsal (`dispatch rehearse --engine sglang`): SGLang's own launcher on a
checkpoint, once with capdispatch's plugin and once without, the same greedy requests to
both, and what they say compared (tokens or logprobs), beside `dispatch plan`'s memory and
`dispatch plan --speed`'s time for the same checkpoint.

launch.py (devices, the launch command, the plugin on/off environment, the requests),
server.py (the server process and its HTTP), verdict.py (records and comparison),
runner.py (the run), render.py (text). docs/rehearse.md, Engine rehearsal."""
from __future__ import annotations
