"""DevicePtr: an integer device address. 0 is NULL. Kernels take pointers and scalars, never arrays."""


class DevicePtr(int):
    __slots__ = ()

    def offset(self, nbytes: int) -> "DevicePtr":
        if self == 0:
            raise ValueError("offset() of a NULL DevicePtr")
        return DevicePtr(int(self) + int(nbytes))

    def __repr__(self) -> str:
        return f"DevicePtr(0x{int(self):x})"


NULL = DevicePtr(0)
