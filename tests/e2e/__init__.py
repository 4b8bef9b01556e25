"""End-to-end tests: `flowrl-ray` run as a subprocess or through `main()` across the whole stack
(demos, pretrain, train, resume, eval, compare, serve, a `ray start` cluster, `ray job submit`)."""
