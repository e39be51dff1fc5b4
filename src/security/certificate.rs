//! A client certificate's names: the SAN URIs (SPIFFE IDs) and DNS names
//! the auth policy matches an identity on. The TLS handshake has already
//! verified the certificate; this only reads it.

use x509_cert::{
    Certificate,
    der::Decode,
    ext::pkix::{SubjectAltName, name::GeneralName},
};

/// The URI and DNS-name SANs of a DER certificate, URIs first; empty when
/// the certificate has none or cannot be read.
pub(crate) fn subject_alt_names(der: &[u8]) -> Vec<String> {
    let Ok(certificate) = Certificate::from_der(der) else {
        return Vec::new();
    };
    let Ok(Some((_, SubjectAltName(names)))) = certificate.tbs_certificate.get::<SubjectAltName>()
    else {
        return Vec::new();
    };
    let mut uris = Vec::new();
    let mut dns = Vec::new();
    for name in names {
        match name {
            GeneralName::UniformResourceIdentifier(uri) => uris.push(uri.to_string()),
            GeneralName::DnsName(host) => dns.push(host.to_string()),
            _ => {}
        }
    }
    uris.extend(dns);
    uris
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_and_dns_sans_are_read() {
        let mut params = rcgen::CertificateParams::new(vec!["worker-a.svc".to_string()]).unwrap();
        params.subject_alt_names.push(rcgen::SanType::URI(
            rcgen::string::Ia5String::try_from("spiffe://t/worker-a").unwrap(),
        ));
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        assert_eq!(
            subject_alt_names(cert.der()),
            ["spiffe://t/worker-a", "worker-a.svc"]
        );
        assert!(subject_alt_names(b"not a certificate").is_empty());
    }
}
