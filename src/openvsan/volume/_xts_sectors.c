/* The sector loop of luks2.Xts in C: many aes-xts-plain64 data units in one call.
 *
 * AES-XTS itself stays OpenSSL's (libcrypto, the one `cryptography` runs on): this file only walks the
 * sectors of a buffer, sets each sector's tweak (its number, little-endian, in the IV's first 8 bytes:
 * plain64) on an EVP context kept with its key schedule, and runs the update over that sector. From Python,
 * the same walk costs two ctypes calls per sector (about 2 us: 0.5 ms for a MiB of 4 KiB sectors, against
 * 0.15 ms of AES); here it costs the AES.
 *
 * It needs neither Python's nor OpenSSL's headers and links to nothing: the caller passes the addresses of
 * libcrypto's EVP_CipherInit_ex and EVP_CipherUpdate, which it has loaded already. ovs_xts_sectors_gcry is the
 * same walk over libgcrypt's XTS (gcry_cipher_setiv, then gcry_cipher_encrypt or _decrypt per sector), which
 * luks2.py prefers where libgcrypt loads: its AES-NI/VAES XTS takes a 4 KiB sector in half the time of
 * OpenSSL 3.0's (docs/benchmarks.md). luks2.py loads this file's shared object with ctypes; where it was not
 * built (no C compiler when openvsan was installed) the same loop runs in Python, with the same bytes
 * (tests/unit/test_luks2.py checks every way agrees).
 */

#include <stddef.h>
#include <stdint.h>

typedef int (*evp_init_fn)(void *ctx, const void *cipher, void *engine, const unsigned char *key,
                           const unsigned char *iv, int enc);
typedef int (*evp_update_fn)(void *ctx, unsigned char *out, int *outl, const unsigned char *in, int inl);

/* A sector's tweak (plain64): its number, little-endian, in the IV's first 8 bytes; the rest stays zero. */
static void plain64(unsigned char iv[16], uint64_t sector)
{
    int b;

    for (b = 0; b < 8; b++)
        iv[b] = (unsigned char)(sector >> (8 * b));
}

/* Encrypt or decrypt (as ctx was set up) length bytes of in into out, sector_size bytes per data unit, the
 * first unit's tweak sector and each next one's step more (wrapping at 2^64, as dm-crypt's plain64 does).
 * 0 when done, -1 when OpenSSL failed a call (out is then undefined). length is a whole number of sectors. */
int ovs_xts_sectors(void *init, void *update, void *ctx, unsigned char *out, const unsigned char *in,
                    size_t length, size_t sector_size, uint64_t sector, uint64_t step)
{
    unsigned char iv[16] = {0};
    int outl;
    size_t at;

    for (at = 0; at + sector_size <= length; at += sector_size, sector += step) {
        plain64(iv, sector);
        if (((evp_init_fn)init)(ctx, NULL, NULL, NULL, iv, -1) != 1 ||
            ((evp_update_fn)update)(ctx, out + at, &outl, in + at, (int)sector_size) != 1)
            return -1;
    }
    return 0;
}

typedef unsigned int (*gcry_setiv_fn)(void *handle, const void *iv, size_t ivlen);
typedef unsigned int (*gcry_crypt_fn)(void *handle, void *out, size_t outsize, const void *in, size_t inlen);

/* The same walk on a libgcrypt XTS handle (its key set): crypt is gcry_cipher_encrypt or gcry_cipher_decrypt.
 * 0 when done, -1 when libgcrypt failed a call. */
int ovs_xts_sectors_gcry(void *setiv, void *crypt, void *handle, unsigned char *out, const unsigned char *in,
                         size_t length, size_t sector_size, uint64_t sector, uint64_t step)
{
    unsigned char iv[16] = {0};
    size_t at;

    for (at = 0; at + sector_size <= length; at += sector_size, sector += step) {
        plain64(iv, sector);
        if (((gcry_setiv_fn)setiv)(handle, iv, 16) != 0 ||
            ((gcry_crypt_fn)crypt)(handle, out + at, sector_size, in + at, sector_size) != 0)
            return -1;
    }
    return 0;
}
