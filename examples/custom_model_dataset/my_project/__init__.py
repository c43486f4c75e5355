"""A user's own code: a model and a dataset that ftjob builds from config via _target_."""
