"""Test support shipped with fmstore: the Store conformance suite, a SeaweedFS server
launcher and a fault-injecting proxy (third-party backends can run the same suite), the
multi-node cluster and torchrun launchers, and the deterministic simulation of the
multi-node protocol (:mod:`.sim`)."""
