"""hispec_train: distil early-exit heads into a frozen base (see the training issue).

It imports the adapter format and head modules from :mod:`hispec_decode`, never the reverse.
"""
