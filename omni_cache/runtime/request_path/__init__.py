"""A request from admission to its last event: the request table, admission bounds, results and
the assembly of stage outputs into client events, resumption on another replica, and its ends."""
