"""What the compression policies keep and what they cost: which rows of a fact a selection
keeps, an oracle that knows the questions, the scoring and re-selection costs, and the KVzap
surrogates' training and thresholds (in-process ``Engine``)."""
