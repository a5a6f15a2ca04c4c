"""The assistant world: how whet is shown to learn.

Tasks and their checkers over the bundled MCP servers (:mod:`whet.world.tasks`), the
simulated user who asks them and replies (:mod:`whet.world.user`), the supervised
conversations the default model is warm-started on (:mod:`whet.world.conversations`,
:mod:`whet.world.warmstart`) and the learning benchmark, ``whet bench learn``
(:mod:`whet.world.bench`).

It depends on ``servers``, ``learner``, ``memory`` and ``config``; the runtime depends on
it, the learner never does.
"""
