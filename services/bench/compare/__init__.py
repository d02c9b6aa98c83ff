"""``epd bench compare``: ``epd up`` in its modes beside any OpenAI-compatible server, same workloads, one table.

``workloads`` builds the seeded requests, ``servers`` starts and stops each
server (one alone on the machine at a time), ``report`` turns the runs into
the table and the ratios, ``command`` is the entry point. Imports only the
bench client and the standard library: the client never needs torch.
"""
