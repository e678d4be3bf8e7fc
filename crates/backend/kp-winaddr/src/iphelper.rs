//! The IP Helper calls. Every `unsafe` here is a call into `iphlpapi.dll` (or reading the
//! table it returned), with the argument rules of its documentation noted at each call.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use kp_userspace::AddressHost;
use windows_sys::Win32::NetworkManagement::IpHelper::{
    MIB_UNICASTIPADDRESS_ROW, MIB_UNICASTIPADDRESS_TABLE,
};
use windows_sys::Win32::NetworkManagement::Ndis::NET_LUID_LH;
use windows_sys::Win32::Networking::WinSock::{
    AF_INET, AF_INET6, AF_UNSPEC, IpDadStateDeprecated, IpDadStatePreferred, IpPrefixOriginManual,
    IpSuffixOriginManual,
};
use windows_sys::Win32::System::LibraryLoader::{GetProcAddress, LoadLibraryW};

type GetTable = unsafe extern "system" fn(u16, *mut *mut MIB_UNICASTIPADDRESS_TABLE) -> u32;
type FreeTable = unsafe extern "system" fn(*const c_void);
type RowCall = unsafe extern "system" fn(*const MIB_UNICASTIPADDRESS_ROW) -> u32;
type AliasToLuid = unsafe extern "system" fn(*const u16, *mut NET_LUID_LH) -> u32;

/// The functions found in `iphlpapi.dll` (`None`: not there).
#[derive(Clone, Copy, Debug, Default)]
struct Api {
    get_table: Option<GetTable>,
    free_table: Option<FreeTable>,
    create: Option<RowCall>,
    delete: Option<RowCall>,
    alias_to_luid: Option<AliasToLuid>,
}

/// Looks `name` (NUL-terminated) up in `module`.
fn lookup(module: *mut c_void, name: &[u8]) -> Option<unsafe extern "system" fn() -> isize> {
    if module.is_null() || name.last() != Some(&0) {
        return None;
    }
    // SAFETY: `module` is a loaded module's handle and `name` a NUL-terminated ANSI string.
    unsafe { GetProcAddress(module, name.as_ptr()) }
}

impl Api {
    fn load() -> Self {
        let library: Vec<u16> = "iphlpapi.dll\0".encode_utf16().collect();
        // SAFETY: a NUL-terminated UTF-16 file name; the module stays loaded for the process.
        let module = unsafe { LoadLibraryW(library.as_ptr()) };
        // SAFETY (each transmute): the symbol is the documented function of that name, whose
        // signature is the type it is cast to.
        unsafe {
            Api {
                get_table: lookup(module, b"GetUnicastIpAddressTable\0")
                    .map(|f| std::mem::transmute::<_, GetTable>(f)),
                free_table: lookup(module, b"FreeMibTable\0")
                    .map(|f| std::mem::transmute::<_, FreeTable>(f)),
                create: lookup(module, b"CreateUnicastIpAddressEntry\0")
                    .map(|f| std::mem::transmute::<_, RowCall>(f)),
                delete: lookup(module, b"DeleteUnicastIpAddressEntry\0")
                    .map(|f| std::mem::transmute::<_, RowCall>(f)),
                alias_to_luid: lookup(module, b"ConvertInterfaceAliasToLuid\0")
                    .map(|f| std::mem::transmute::<_, AliasToLuid>(f)),
            }
        }
    }
}

/// `iphlpapi.dll` lacks `name`.
fn missing(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!("iphlpapi.dll has no {name} (Wine implements it only as a stub)"),
    )
}

/// A Win32 error code as an I/O error (`0` is success).
fn check(code: u32) -> io::Result<()> {
    match code {
        0 => Ok(()),
        code => Err(io::Error::from_raw_os_error(
            i32::try_from(code).unwrap_or(i32::MAX),
        )),
    }
}

/// Service addresses on one interface through the IP Helper API.
#[derive(Debug)]
pub struct IpHelper {
    interface: String,
    api: Api,
}

impl IpHelper {
    /// Adds addresses to the interface named `interface` (its alias, as `netsh` and
    /// `Get-NetAdapter` show it). Which functions exist is looked up now; a missing one is
    /// an error when it is needed.
    pub fn new(interface: &str) -> Self {
        Self {
            interface: interface.to_owned(),
            api: Api::load(),
        }
    }

    /// The interface's LUID.
    fn luid(&self) -> io::Result<NET_LUID_LH> {
        let convert = self
            .api
            .alias_to_luid
            .ok_or_else(|| missing("ConvertInterfaceAliasToLuid"))?;
        let alias: Vec<u16> = self.interface.encode_utf16().chain([0]).collect();
        let mut luid = NET_LUID_LH { Value: 0 };
        // SAFETY: a NUL-terminated alias and a valid out pointer.
        check(unsafe { convert(alias.as_ptr(), &mut luid) })?;
        Ok(luid)
    }

    /// Every unicast address row of the host, copied out of the table.
    fn rows(&self) -> io::Result<Vec<MIB_UNICASTIPADDRESS_ROW>> {
        let get = self
            .api
            .get_table
            .ok_or_else(|| missing("GetUnicastIpAddressTable"))?;
        let free = self.api.free_table.ok_or_else(|| missing("FreeMibTable"))?;
        let mut table: *mut MIB_UNICASTIPADDRESS_TABLE = std::ptr::null_mut();
        // SAFETY: a valid out pointer; on success the table is ours until FreeMibTable.
        check(unsafe { get(AF_UNSPEC, &mut table) })?;
        if table.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the table holds `NumEntries` rows laid out from `Table`; we copy them and
        // free the table once.
        unsafe {
            let count = usize::try_from((*table).NumEntries).unwrap_or(0);
            let first = std::ptr::addr_of!((*table).Table).cast::<MIB_UNICASTIPADDRESS_ROW>();
            let rows = std::slice::from_raw_parts(first, count).to_vec();
            free(table.cast());
            Ok(rows)
        }
    }

    /// The rows holding `ip`.
    fn rows_of(&self, ip: IpAddr) -> io::Result<Vec<MIB_UNICASTIPADDRESS_ROW>> {
        Ok(self
            .rows()?
            .into_iter()
            .filter(|row| address(row) == Some(ip))
            .collect())
    }
}

/// A row's address.
fn address(row: &MIB_UNICASTIPADDRESS_ROW) -> Option<IpAddr> {
    // SAFETY: `si_family` says which member of the union is set.
    unsafe {
        match row.Address.si_family {
            AF_INET => Some(IpAddr::V4(Ipv4Addr::from(
                row.Address.Ipv4.sin_addr.S_un.S_addr.to_ne_bytes(),
            ))),
            AF_INET6 => Some(IpAddr::V6(Ipv6Addr::from(
                row.Address.Ipv6.sin6_addr.u.Byte,
            ))),
            _ => None,
        }
    }
}

/// A row adding `ip` (a host route: /32 or /128) to the interface `luid`, manual origin,
/// no expiry.
fn new_row(ip: IpAddr, luid: NET_LUID_LH) -> MIB_UNICASTIPADDRESS_ROW {
    let mut row = MIB_UNICASTIPADDRESS_ROW::default();
    match ip {
        IpAddr::V4(v4) => {
            row.Address.Ipv4.sin_family = AF_INET;
            row.Address.Ipv4.sin_addr.S_un.S_addr = u32::from_ne_bytes(v4.octets());
            row.OnLinkPrefixLength = 32;
        }
        IpAddr::V6(v6) => {
            row.Address.Ipv6.sin6_family = AF_INET6;
            row.Address.Ipv6.sin6_addr.u.Byte = v6.octets();
            row.OnLinkPrefixLength = 128;
        }
    }
    row.InterfaceLuid = luid;
    row.PrefixOrigin = IpPrefixOriginManual;
    row.SuffixOrigin = IpSuffixOriginManual;
    row.ValidLifetime = u32::MAX;
    row.PreferredLifetime = u32::MAX;
    row.DadState = IpDadStatePreferred;
    row
}

impl AddressHost for IpHelper {
    fn interface(&self) -> &str {
        &self.interface
    }

    /// Present and past duplicate address detection (preferred or deprecated).
    fn has(&self, ip: IpAddr) -> io::Result<bool> {
        Ok(self
            .rows_of(ip)?
            .iter()
            .any(|row| row.DadState == IpDadStatePreferred || row.DadState == IpDadStateDeprecated))
    }

    fn add(&mut self, ip: IpAddr) -> io::Result<()> {
        let create = self
            .api
            .create
            .ok_or_else(|| missing("CreateUnicastIpAddressEntry"))?;
        let row = new_row(ip, self.luid()?);
        // SAFETY: a fully initialised row.
        check(unsafe { create(&row) })
    }

    fn remove(&mut self, ip: IpAddr) -> io::Result<()> {
        let delete = self
            .api
            .delete
            .ok_or_else(|| missing("DeleteUnicastIpAddressEntry"))?;
        // SAFETY (both reads): LUIDs are plain 64-bit values whichever member was written.
        let luid = unsafe { self.luid()?.Value };
        let row = self
            .rows_of(ip)?
            .into_iter()
            .find(|row| unsafe { row.InterfaceLuid.Value } == luid)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "not on the interface"))?;
        // SAFETY: a row as the table returned it.
        check(unsafe { delete(&row) })
    }
}
