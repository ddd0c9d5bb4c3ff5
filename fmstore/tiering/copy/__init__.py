"""The copy engine: many objects between two stores, parallel, verified and resumable
(:mod:`.transfer`), its resume journal (:mod:`.journal`), and the copy of the blobs a
checkpoint manifest names (:mod:`.blobcopy`).  Knows nothing of policies or managers."""
