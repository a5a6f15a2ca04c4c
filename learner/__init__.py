"""whet.learner."""
