//! Parsing EndpointSlices and merging them into per-service-port endpoint lists.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::api::discovery::v1::{Endpoint as ApiEndpoint, EndpointSlice};

use super::parse::parse_ip;
use super::{
    Endpoint, IpFamily, ModelError, Name, Names, Problems, Protocol, ServiceName, ServicePortName,
    SliceEndpoints, port_number,
};

/// The label naming the Service an EndpointSlice belongs to.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Parse one EndpointSlice. `None` for slices the proxy ignores (no service-name label,
/// FQDN address type).
///
/// Only each endpoint's first address is used (and checked), as upstream: the API says the
/// others are fungible. Port entries without a port number (or with 0) are skipped, as
/// upstream does; they mean "all ports", which no proxy implements.
pub fn slice_endpoints(slice: &EndpointSlice) -> Result<Option<SliceEndpoints>, ModelError> {
    slice_endpoints_with(slice, &mut Names::default())
}

/// [`slice_endpoints`], taking node and zone names from `names`, so endpoints parsed with the
/// same `names` share them.
pub fn slice_endpoints_with(
    slice: &EndpointSlice,
    names: &mut Names,
) -> Result<Option<SliceEndpoints>, ModelError> {
    let meta = &slice.metadata;
    let Some(service) = meta
        .labels
        .as_ref()
        .and_then(|labels| labels.get(SERVICE_NAME_LABEL))
        .filter(|service| !service.is_empty())
    else {
        return Ok(None);
    };
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    let name = meta.name.as_deref().unwrap_or_default();
    let mut problems = Problems::default();
    let family = match slice.address_type.as_str() {
        "IPv4" => Some(IpFamily::V4),
        "IPv6" => Some(IpFamily::V6),
        "FQDN" => return Ok(None),
        other => {
            problems.push(
                "addressType",
                format_args!("{other:?} is not IPv4, IPv6 or FQDN"),
            );
            None
        }
    };
    let ports = slice_ports(slice, names, &mut problems);
    let endpoints = slice_endpoint_list(slice, family, names, &mut problems);

    problems.into_result("EndpointSlice", namespace, name)?;
    let Some(family) = family else {
        // Unreachable: an unknown addressType was recorded as a problem above.
        return Ok(None);
    };
    Ok(Some(SliceEndpoints {
        service: ServiceName {
            namespace: names.get(namespace),
            name: names.get(service),
        },
        family,
        ports,
        endpoints,
    }))
}

/// The slice's usable ports; entries with a problem are recorded and left out, portless ones
/// ("all ports") silently.
fn slice_ports(
    slice: &EndpointSlice,
    names: &mut Names,
    problems: &mut Problems,
) -> Vec<(Name, Protocol, u16)> {
    // Sized up front: thousands of these are held at once, and growth would leave spare room.
    let mut ports = Vec::with_capacity(slice.ports.as_ref().map_or(0, Vec::len));
    let mut seen: BTreeMap<(&str, Protocol), usize> = BTreeMap::new();
    for (index, port) in slice.ports.iter().flatten().enumerate() {
        let port_name = port.name.as_deref().unwrap_or_default();
        let protocol = match port.protocol.as_deref() {
            None => Protocol::Tcp,
            Some(text) => match Protocol::from_api(text) {
                Some(protocol) => protocol,
                None => {
                    problems.push(
                        format_args!("ports[{index}].protocol"),
                        format_args!("{text:?} is not TCP, UDP or SCTP"),
                    );
                    continue;
                }
            },
        };
        let number = match port.port {
            None | Some(0) => continue,
            Some(value) => match port_number(value) {
                Ok(number) => number,
                Err(message) => {
                    problems.push(format_args!("ports[{index}].port"), message);
                    continue;
                }
            },
        };
        if let Some(first) = seen.get(&(port_name, protocol)) {
            problems.push(
                format_args!("ports[{index}]"),
                format_args!(
                    "duplicate port name {port_name:?} with protocol {} (also ports[{first}])",
                    protocol.api_name()
                ),
            );
            continue;
        }
        seen.insert((port_name, protocol), index);
        ports.push((names.get(port_name), protocol, number));
    }
    ports
}

/// The slice's endpoints whose first address is usable; the others are recorded as problems.
fn slice_endpoint_list(
    slice: &EndpointSlice,
    family: Option<IpFamily>,
    names: &mut Names,
    problems: &mut Problems,
) -> Vec<Endpoint> {
    let mut endpoints = Vec::with_capacity(slice.endpoints.len());
    for (index, endpoint) in slice.endpoints.iter().enumerate() {
        if let Some(ip) = first_address(index, endpoint, family, problems) {
            endpoints.push(slice_endpoint(endpoint, ip, names));
        }
    }
    endpoints
}

/// An endpoint's first address, if it parses and is of the slice's `family` (unchecked when
/// the family is unknown: that is a problem of its own).
fn first_address(
    index: usize,
    endpoint: &ApiEndpoint,
    family: Option<IpFamily>,
    problems: &mut Problems,
) -> Option<IpAddr> {
    let Some(text) = endpoint.addresses.first() else {
        problems.push(
            format_args!("endpoints[{index}].addresses"),
            "must not be empty",
        );
        return None;
    };
    let path = format_args!("endpoints[{index}].addresses[0]");
    let ip = match parse_ip(text) {
        Ok(ip) => ip,
        Err(error) => {
            problems.push(path, format_args!("{text:?} {error}"));
            return None;
        }
    };
    if let Some(family) = family
        && IpFamily::of(&ip) != family
    {
        problems.push(
            path,
            format_args!(
                "{text:?} is not an {} address (addressType {})",
                family.api_name(),
                family.api_name()
            ),
        );
        return None;
    }
    Some(ip)
}

/// The model's endpoint at `ip`, with the API's condition defaults; port and locality are
/// filled in when merging.
fn slice_endpoint(endpoint: &ApiEndpoint, ip: IpAddr, names: &mut Names) -> Endpoint {
    let conditions = endpoint.conditions.as_ref();
    // API semantics: unknown readiness means ready; serving defaults to ready.
    let ready = conditions.and_then(|c| c.ready).unwrap_or(true);
    let serving = conditions.and_then(|c| c.serving).unwrap_or(ready);
    let terminating = conditions.and_then(|c| c.terminating).unwrap_or(false);
    let hints = endpoint.hints.as_ref();
    Endpoint {
        ip,
        port: 0,
        ready,
        serving,
        terminating,
        node_name: endpoint.node_name.as_deref().map(|name| names.get(name)),
        zone: endpoint.zone.as_deref().map(|zone| names.get(zone)),
        zone_hints: hint_names(hints.and_then(|h| h.for_zones.as_deref()), |zone| {
            &zone.name
        }),
        node_hints: hint_names(hints.and_then(|h| h.for_nodes.as_deref()), |node| {
            &node.name
        }),
        is_local: false,
    }
}

/// Hint names, or `None` when there are none (an empty hint list is no hint, as upstream).
// Boxed on purpose: `Endpoint` holds two of these, usually `None`, in ~10^5 endpoints.
#[allow(clippy::box_collection)]
fn hint_names<T>(
    hints: Option<&[T]>,
    name: impl Fn(&T) -> &String,
) -> Option<Box<BTreeSet<String>>> {
    let names: BTreeSet<String> = hints.into_iter().flatten().map(name).cloned().collect();
    (!names.is_empty()).then(|| Box::new(names))
}

/// Merge the slices of one service into per-service-port endpoint lists, sorted and
/// de-duplicated, with `is_local` computed against `node_name`.
///
/// An `ip:port` listed more than once (endpoints move between slices, and a stale copy may
/// linger) keeps the entry from the first slice in iteration order, so callers that need a
/// stable result should pass slices in a stable order (for example by slice name). Lists are
/// sorted by address, then port. Service ports without any endpoint get no entry, as
/// upstream. An endpoint is local only if this node has a name and the endpoint names it.
pub fn merge_slices<'a>(
    slices: impl IntoIterator<Item = &'a SliceEndpoints>,
    node_name: &str,
) -> BTreeMap<ServicePortName, Vec<Endpoint>> {
    let mut merged: BTreeMap<ServicePortName, BTreeMap<(IpAddr, u16), Endpoint>> = BTreeMap::new();
    for slice in slices {
        for (port_name, protocol, port) in &slice.ports {
            let key = ServicePortName {
                service: slice.service.clone(),
                port: port_name.clone(),
                protocol: *protocol,
            };
            let by_address = merged.entry(key).or_default();
            for endpoint in &slice.endpoints {
                by_address
                    .entry((endpoint.ip, *port))
                    .or_insert_with(|| Endpoint {
                        port: *port,
                        is_local: !node_name.is_empty()
                            && endpoint.node_name.as_deref() == Some(node_name),
                        ..endpoint.clone()
                    });
            }
        }
    }
    merged
        .into_iter()
        .filter(|(_, by_address)| !by_address.is_empty())
        .map(|(key, by_address)| (key, by_address.into_values().collect()))
        .collect()
}
