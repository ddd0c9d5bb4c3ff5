"""Checkpoints carried between tiers: whole (:mod:`.mover`), in node parts whose last one
commits (:mod:`.parts`), a lost node's part from its replica (:mod:`.replica_export`), and the
retirement of a generation a restore abandoned (:mod:`.retire`)."""
