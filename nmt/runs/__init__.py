"""Run folders: the files a run writes, by name, and their readers."""
