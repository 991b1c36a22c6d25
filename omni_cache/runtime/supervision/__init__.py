"""The stage processes: started (locally or placed on Ray), watched (heartbeats, hung steps,
connections), restarted and stopped; the ZMQ links to them and the counters they report."""
