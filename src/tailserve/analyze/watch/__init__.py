"""``tailserve watch URL``: a running server's SLO board, with no load sent.

It scrapes ``/metrics`` (any engine engines/ knows) every few seconds and, from tailserve,
the step timeline; each pair of scrapes is a window whose TTFT and ITL histogram deltas give
the share within the SLO and the P99 (as the buckets bound them: hist.py), and whose
counters and gauges name the likely cause when the P99 jumps (window.py). ``watcher.py``
holds the loop's state, ``view.py`` the terminal, JSON and dashboard renderings; the NVML
watermark is bench/gpu.py's (bench records it too); the CLI (cli/watch.py) drives it and
serves the dashboard page.
"""
