"""Records one cache can serve to engines of any tensor-parallel size: the head layout of a
rank (`layout`), pages cut into heads (`pages`), records and their keys (`records`), and the
storage tier that reads and writes them (`tier`)."""
