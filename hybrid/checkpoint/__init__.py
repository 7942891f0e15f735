"""The checkpoint format, declared once and used by training, conversion and evaluation alike: DeepSpeed's
files plus what hybrid adds to them.

Modules:
  files         file names, tags, pointer files, atomic writes, one file read safely
  manifest      the list of a checkpoint's files with their checksums (integrity)
  client_state  hybrid's records in DeepSpeed's files (ClientState, SavedLayout)
  tp_layout     each parameter's tensor-parallel split and DeepSpeed's universal-checkpoint patterns
"""
