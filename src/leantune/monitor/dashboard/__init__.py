"""`leantune dashboard`: a live view of the runs in a folder, read from their run directories.

`runs` finds the runs and reads what the pages show, `status` says where each run stands,
`series` reads JSONL files while a run appends to them, `server` answers HTTP, and `static/`
holds the pages, their chart library (`leanchart.js`) and style: every asset is served by
leantune itself.
"""

from leantune.monitor.dashboard.server import make_server, serve

__all__ = ["make_server", "serve"]
