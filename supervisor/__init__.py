"""trainwarden's supervisor: launches ranks, watches them, relaunches from the newest complete checkpoint.

It never imports torch, so it starts fast and stays small.
"""
