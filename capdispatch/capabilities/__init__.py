"""What a device is and has. Imports nothing of ours and never torch at import."""
from .catalog import UnknownDeviceError
from .features import derive as derive_features
from .libraries import Inventory, LibraryFact
from .probing import AssumeCudaError, ProbeError, local_devices, parse_device, probe
from .spec import DeviceSpec

__all__ = ["AssumeCudaError", "DeviceSpec", "Inventory", "LibraryFact", "ProbeError", "UnknownDeviceError",
           "derive_features", "local_devices", "parse_device", "probe"]
