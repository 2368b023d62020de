"""The models: the target adapter (dense and hybrid), the DFlash drafter, draft vocabularies, fp8 drafts, and
fetching checkpoints.
"""
