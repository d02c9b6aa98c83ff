"""Code shared by every service: config, gRPC plumbing, tensors, hashing, models.

Nothing here imports a service package; services meet only through ``protos/``.
"""
