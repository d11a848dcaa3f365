"""`potluck monitor`: follow a run, keep a durable ledger of who contributed what, and show it live."""

from potluck.monitor.views import Contributor, EpochRow, HistoryPoint, MonitorView, PeerState, SwarmNow

__all__ = ["Contributor", "EpochRow", "HistoryPoint", "MonitorView", "PeerState", "SwarmNow"]
