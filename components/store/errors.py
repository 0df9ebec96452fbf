"""The store's errors, apart so that every module of the package can raise them."""


class StoreError(RuntimeError):
    """A store operation failed; nothing was committed."""


class StoreLockedError(StoreError):
    """The catalog stayed busy (another writer's commit): transient, worth a retry."""
