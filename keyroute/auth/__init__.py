"""Auth: who a caller or member is (certificates, tokens, signing keys) and what it may do (access rules,
sealed cursors' key).
"""
