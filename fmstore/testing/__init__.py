"""Test support shipped with fmstore: the Store conformance suite, a SeaweedFS server
launcher and a fault-injecting proxy.  Third-party backends can run the same suite."""
