"""What travels between processes: message types, the ZMQ transport, stage auth, ipc path claims."""
