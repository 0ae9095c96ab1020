"""The schedule: when each collective is issued, in one order on every rank. It owns the element
ranges of a flat buffer (`ranges.py`), what a bucket becomes on the wire, decided once (`recipes.py`),
the collective fingerprints and their cross-rank comparison (`order.py`), the ordered schedule with
its release points (`schedule.py`) and the `Dispatcher` with its issuing thread, futures and bounded
waits (`dispatch.py`), through which every collective of an engine goes. It sits on the watch.
"""
