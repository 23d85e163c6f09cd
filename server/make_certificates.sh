#!/usr/bin/env bash
# Certificates and keys for a fed-dp deployment (Flower SuperLink + SuperNodes).
#
#     bash server/make_certificates.sh DIR [NODES]
#
# Creates in DIR (all keys ECDSA P-384):
#     ca.crt, ca.key          a self-signed certificate authority: give ca.crt to every SuperNode
#                             (--root-certificates) and to the `flwr` CLI; keep ca.key private
#     server.pem, server.key  the SuperLink's certificate, signed by the CA, with subjectAltName
#                             localhost, 127.0.0.1 and ::1 plus the entries of $SUPERLINK_SAN
#                             (e.g. SUPERLINK_SAN="DNS:superlink.example.org,IP:10.0.0.5")
#     node<i>, node<i>.pub    for i < NODES (default 0): SuperNode authentication key pairs in OpenSSH
#                             format (`flower-supernode --auth-supernode-private-key node<i>`,
#                             `flwr supernode register node<i>.pub <federation>`)
#
# Idempotent: existing files are kept, so a second run only adds what is missing (e.g. more node keys), except
# that server.pem is issued again when $SUPERLINK_SAN asks for other names than it has.
# Delete DIR to start afresh. Needs openssl and, for node keys, ssh-keygen. $CERT_DAYS: validity (365).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || ! ${2:-0} =~ ^[0-9]+$ ]]; then
    echo "usage: $0 DIR [NODES]   (NODES: number of SuperNode authentication key pairs, default 0)" >&2
    exit 2
fi
out=$1
nodes=${2:-0}
days=${CERT_DAYS:-365}
san="DNS:localhost,IP:127.0.0.1,IP:::1${SUPERLINK_SAN:+,$SUPERLINK_SAN}"

command -v openssl >/dev/null || { echo "$0: openssl is required" >&2; exit 1; }
if ((nodes > 0)); then
    command -v ssh-keygen >/dev/null || { echo "$0: ssh-keygen is required for node keys" >&2; exit 1; }
fi
mkdir -p "$out"
cd "$out"
umask 077 # private keys readable by their owner only
cnf=$(mktemp)
trap 'rm -f "$cnf" server.csr ca.srl' EXIT
cat >"$cnf" <<CNF
[req]
distinguished_name = dn
prompt = no
[dn]
CN = localhost
[ca]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
subjectAltName = $san
CNF

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-384 -out "$1"; }

if [[ ! -s ca.key || ! -s ca.crt ]]; then
    new_key ca.key
    openssl req -x509 -new -key ca.key -sha384 -days "$days" -subj "/CN=fed-dp deployment CA" \
        -config "$cnf" -extensions ca -out ca.crt
    rm -f server.pem # a new CA invalidates the old server certificate
fi

# The server certificate is issued again (same key) when $SUPERLINK_SAN asks for names it lacks (a second run
# with $SUPERLINK_SAN); server.san records the names of server.pem. Without $SUPERLINK_SAN it is kept as it is.
if [[ ! -s server.key || ! -s server.pem || ( -n "${SUPERLINK_SAN:-}" && "$(cat server.san 2>/dev/null)" != "$san" ) ]]; then
    [[ -s server.key ]] || new_key server.key
    openssl req -new -key server.key -config "$cnf" -out server.csr
    openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" -sha384 \
        -extfile "$cnf" -extensions server -out server.pem 2>/dev/null
    echo "$san" >server.san
fi
chmod 644 ca.crt server.pem server.san

for ((i = 0; i < nodes; i++)); do
    if [[ ! -s node$i || ! -s node$i.pub ]]; then
        rm -f "node$i" "node$i.pub"
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "fed-dp supernode $i" -f "node$i"
    fi
    chmod 644 "node$i.pub"
done

openssl verify -x509_strict -CAfile ca.crt server.pem >/dev/null
echo "$(pwd): ca.crt, server.pem (subjectAltName $(cat server.san 2>/dev/null || echo "as issued earlier")), server.key; node keys: $nodes"
