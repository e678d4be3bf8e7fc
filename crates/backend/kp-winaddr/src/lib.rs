//! winuserspace's service addresses on Windows: `IpHelper` adds, finds and removes
//! unicast addresses of one interface with the IP Helper API (`CreateUnicastIpAddressEntry`,
//! `GetUnicastIpAddressTable`, `DeleteUnicastIpAddressEntry`), as
//! `kp_userspace::AddressHost`. The functions are looked up in `iphlpapi.dll` when the proxy
//! starts, not linked: Wine, which runs the Windows build in this project's tests, lacks some
//! of them, and a missing one must be an error naming it, not a program that cannot load.
//!
//! The reference counting and the bounded wait are `kp_userspace::ServiceAddresses`'; this
//! crate is only the foreign calls. On other platforms it is empty.

#[cfg(windows)]
mod iphelper;

#[cfg(windows)]
pub use iphelper::IpHelper;
