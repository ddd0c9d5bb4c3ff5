"""The multi-node protocol: what nodes write to agree on a step (:mod:`.records`: part
records, export leases, retirements), the decisions taken on what they read
(:mod:`.decisions`: committed, record holds, lease alive, commit holds, replica export due;
:mod:`.routing`: who serves a saved rank; :mod:`.placement`: where replicas go;
:mod:`.skew`: clocks that disagree), the typed problems ranks exchange
(:mod:`.problems`) and the bounded messages they exchange them in (:mod:`.wire`).

Below ``checkpoint`` and ``tiering`` (which read the facts and act on the answers) and
torch-free at import, so each decision is tested as a function of what was read, without
a store or a process group (docs/distributed.md, "Invariants")."""
